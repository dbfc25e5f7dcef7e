"""The GPU cache of a host table: hot rows, with their optimizer state, in HBM.

Design (the kernels are in ``xferlib/_kernels/cache.py``):

* 32-way set-associative: a row's set is a hash of its id; a set's 32 ways are one warp's
  lanes, so a lookup compares 32 tags in one instruction and needs no global map of rows.
  A cache of ``K`` rows has ``ceil(K / 32)`` sets; the ways past the ``K``-th are disabled.
* One fused pass per batch (:meth:`DeviceCache.insert`): the batch's distinct rows are
  grouped by set (a device sort of their set ids); one warp per set counts hits, decides
  admission, picks victims, writes dirty victims back to host RAM and fills the new rows.
  Five launches, no host synchronization, no data-dependent allocation. An embedding
  collection's host rows come keyed in set order instead (:class:`SetOrder`: neighbouring
  ids in neighbouring sets, ids a set count apart in hashed ones): the batch sort that
  orders its keys has grouped them, and the pass sorts nothing (three launches).
* Admission on the device: a missed row takes an empty way of its set if there is one (it
  evicts nothing, and the fill replaces the host write-back the row would need otherwise);
  past that, ``"second-sight"`` admits a missed row the second time it misses (a bit per
  hashed row id, set after a batch for its rows served from the host; TinyLFU's doorkeeper:
  under a Zipf law most misses are tail rows seen once, and admitting each would move its
  row in and a victim out for nothing);
  ``"always"`` admits every miss while a way is free to take.
* Replacement: empty ways first, then the least recently (``"lru"``: the tick of the last
  use) or least often (``"lfu"``: the use count) used way; never a way the current batch
  uses, and for a prefetch never one the cache pass before it used (that batch's update may
  run beside the prefetch; an update of any other batch waits for the prefetch before it
  locates its rows: ``prefetch.must_wait``).
* Updates of cached rows happen in HBM and mark the slot dirty; dirty rows are written back
  when evicted and by :meth:`DeviceCache.flush` (``numpy()``, ``state()``, ``save()``).

:class:`CacheModel` is the same policy in NumPy, step for step: the oracle of the GPU tests
and what CPU CI checks the policy with.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xferlib._backend import finish_current_stream
from xferlib._kernels import grid_1d, named

__all__ = ["CacheModel", "DeviceCache", "NO_SET_ORDER", "SetOrder", "WAYS", "cache_sets",
           "set_of"]

WAYS = 32
_DOOR_SALT = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (the kernels' ``mix64``)."""
    x = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def set_of(rows, n_sets: int) -> np.ndarray:
    """The cache set of each row id."""
    return (_mix64(rows) % np.uint64(n_sets)).astype(np.int64)


def cache_sets(cache_rows: int) -> int:
    """Sets of a cache of ``cache_rows`` rows (the ways past the last row are disabled)."""
    return max(1, -(-int(cache_rows) // WAYS))


@dataclasses.dataclass(frozen=True)
class SetOrder:
    """Keys of ``rows`` host rows that come grouped by cache set when sorted: a cached
    collection keys its host rows so, and its cache pass needs no sort by set.

    Row ``x`` is split into ``b = x // n_sets`` and ``a = x % n_sets``; its set is
    ``(a + h(b)) % n_sets`` (``h``: a hash of ``b``), its key ``set * set_size + b``, so
    ``key // set_size`` is the set. Rows next to each other land in sets next to each other
    (the first ``k * n_sets`` rows fill every set ``k`` times, any ``k * n_sets`` neighbours
    put ``k - 1`` to ``k + 1`` in each: frequency-ranked ids spread evenly), and rows
    ``n_sets`` apart in hashed sets. Keys lie below
    ``span = n_sets * set_size`` (less than ``rows + n_sets``). The kernels' twin:
    ``SET_ORDER`` in ``xferlib/_kernels/cache.py``.

    >>> order = SetOrder.for_cache(rows=100, cache_rows=64)
    >>> order.n_sets, order.set_size, order.span
    (2, 50, 100)
    >>> keys = order.key(np.arange(100))
    >>> order.row(keys)[:5].tolist()
    [0, 1, 2, 3, 4]
    >>> np.bincount(order.set(keys[:10])).tolist()  # ten neighbours: five in each set
    [5, 5]
    """

    rows: int
    n_sets: int

    @classmethod
    def for_cache(cls, rows: int, cache_rows: int) -> "SetOrder":
        rows = int(rows)
        if not 0 < rows < 2**31:  # keys of int32 sorts, as the radix sort takes them
            raise ValueError(f"set-ordered keys need 1 to 2**31 - 1 rows, got {rows}")
        return cls(rows, cache_sets(min(int(cache_rows), rows)))

    @property
    def set_size(self) -> int:
        return -(-self.rows // self.n_sets)

    @property
    def span(self) -> int:
        return self.n_sets * self.set_size

    def _shift(self, b) -> np.ndarray:
        golden = np.uint64(0x9E3779B97F4A7C15)
        with np.errstate(over="ignore"):
            return (_mix64(np.asarray(b, np.uint64) + golden)
                    % np.uint64(self.n_sets)).astype(np.int64)

    def key(self, rows) -> np.ndarray:
        b, a = np.divmod(np.asarray(rows, np.int64), self.n_sets)
        return (a + self._shift(b)) % self.n_sets * self.set_size + b

    def row(self, keys) -> np.ndarray:
        sets, b = np.divmod(np.asarray(keys, np.int64), self.set_size)
        return b * self.n_sets + (sets - self._shift(b)) % self.n_sets

    def set(self, keys) -> np.ndarray:
        return np.asarray(keys, np.int64) // self.set_size

    def kernel_args(self) -> dict:
        """The kernels' arguments of this order (``set_size`` 0: rows keyed as themselves,
        their sets hashed)."""
        return dict(set_size=self.set_size)


NO_SET_ORDER = dict(set_size=0)


def _door_bits(num_rows: int) -> int:
    # About a bit per row (collisions only admit a row early), 1 KiB to 32 MiB of HBM.
    return int(min(max(num_rows, 1 << 13), 1 << 28) + 31) // 32 * 32


def _door_bit(rows, door_bits: int) -> np.ndarray:
    return (_mix64(np.asarray(rows, np.uint64) ^ _DOOR_SALT) % np.uint64(door_bits)).astype(
        np.int64)


class CacheModel:
    """The cache's policy in NumPy, the same decisions in the same order as the kernels.

    >>> model = CacheModel(32, num_rows=1000, policy="lru", admission="second-sight")
    >>> bool((model.access(range(32)) >= 0).all())  # empty ways take every miss
    True
    >>> model.access([40, 41]).tolist()       # a full set: first sight served from the host
    [-1, -1]
    >>> (model.access([40, 41]) >= 0).tolist()  # second sight: admitted, evicting
    [True, True]
    >>> model.stats["admitted"], model.stats["evicted"]
    (34, 2)
    """

    def __init__(self, cache_rows: int, num_rows: int, policy: str = "lru",
                 admission: str = "second-sight", set_order: SetOrder | None = None):
        cache_rows = min(cache_rows, num_rows)  # as HostTable sizes its device cache
        self.n_sets = cache_sets(cache_rows)
        self.tags = np.full(self.n_sets * WAYS, -1, np.int64)
        self.tags[cache_rows:] = -2
        self.score = np.zeros_like(self.tags)
        self.last = np.zeros_like(self.tags)
        self.lfu, self.doorkeeper = policy == "lfu", admission == "second-sight"
        # a collection's cache: rows in the sets of their set-ordered keys (else hashed)
        self.set_order = set_order
        self.door_bits = _door_bits(num_rows)
        self.door = np.zeros(self.door_bits, bool)
        self.tick = 0
        self.stats = dict(lookups=0, hits=0, misses=0, admitted=0, evicted=0)

    def access(self, rows, protect_prev: bool = False) -> np.ndarray:
        """Look a batch's rows up (repeats allowed), admitting and evicting as the kernels
        do; returns each distinct row's slot (-1: served from the host), in ascending row
        order."""
        rows = np.unique(np.asarray(rows, np.int64))
        if not rows.size:  # the device runs no cache pass for an empty batch: no tick
            return np.empty(0, np.int64)
        self.tick += 1
        now = self.tick
        slots = np.full(rows.size, -1, np.int64)
        sets = (set_of(rows, self.n_sets) if self.set_order is None
                else self.set_order.set(self.set_order.key(rows)))
        order = np.lexsort((rows, sets))  # by set, then row (the device sort is stable)
        used, first_sight = {}, []
        for k in order:
            row, base = rows[k], sets[k] * WAYS
            ways = slice(base, base + WAYS)
            mask = used.setdefault(base, np.zeros(WAYS, bool))
            self.stats["lookups"] += 1
            found = np.flatnonzero(self.tags[ways] == row)
            if found.size:
                way = found[0]
                self.score[base + way] = self.score[base + way] + 1 if self.lfu else now
                self.last[base + way] = now
                self.stats["hits"] += 1
            else:
                self.stats["misses"] += 1
                way = self._admit(row, base, mask, now, protect_prev)
            if way >= 0:
                mask[way] = True
                slots[k] = base + way
            else:
                first_sight.append(row)
        if self.doorkeeper and first_sight:  # set after the batch, as the kernels do
            self.door[_door_bit(np.array(first_sight), self.door_bits)] = True
        return slots

    def _admit(self, row, base, mask, now, protect_prev) -> int:
        # an empty way takes any miss; the doorkeeper decides only where a row would go
        if self.doorkeeper and not (self.tags[base:base + WAYS] == -1).any():
            if not self.door[_door_bit(row, self.door_bits)]:
                return -1
        tags, last = self.tags[base:base + WAYS], self.last[base:base + WAYS]
        key = np.where(self.lfu, self.score[base:base + WAYS], last).astype(np.float64)
        key[tags == -1] = -np.inf
        key[mask | (tags < -1) | ((tags >= 0) & (last >= now - int(protect_prev)))] = np.inf
        way = int(np.argmin(key))
        if key[way] == np.inf:
            return -1
        if tags[way] >= 0:
            self.stats["evicted"] += 1
        self.tags[base + way] = row
        self.score[base + way] = 1 if self.lfu else now
        self.last[base + way] = now
        self.stats["admitted"] += 1
        return way

    def cached_rows(self) -> np.ndarray:
        return np.sort(self.tags[self.tags >= 0])


class DeviceCache:
    """The cache's arrays in HBM and the launches that use them (see the module docstring).

    ``side`` is the table's device side: host pointers, row layout, vector width.
    ``set_order``: the batches' keys are its set-ordered keys (a collection's, whose sorted
    keys then come grouped by set: no sort by set), else the rows themselves.
    """

    def __init__(self, side, cache_rows: int, policy: str, admission: str,
                 set_order: SetOrder | None = None):
        import cupy

        table = side.table
        self.side = side
        self.n_sets = cache_sets(cache_rows)
        if set_order is not None and (set_order.n_sets != self.n_sets
                                      or set_order.rows != table.num_rows):
            raise ValueError("the set order was made for another cache or table")
        self.set_order = set_order
        self.order_args = set_order.kernel_args() if set_order is not None else NO_SET_ORDER
        n_slots = self.n_sets * WAYS
        self.width = table.layout.row_width
        self.data = cupy.zeros((n_slots, self.width), dtype=table.dtype)
        tags = np.full(n_slots, -1, np.int64)
        tags[cache_rows:] = -2  # ways past cache_rows do not exist
        self.tags = cupy.asarray(tags)
        self.score = cupy.zeros(n_slots, np.int64)
        self.last = cupy.zeros(n_slots, np.int64)
        self.dirty = cupy.zeros(n_slots, np.uint8)
        self.door_bits = _door_bits(table.num_rows)
        self.door = cupy.zeros(self.door_bits // 32, np.uint32)
        self.tick = cupy.zeros(1, np.int64)
        self.stats = cupy.zeros(5, np.uint64)
        self.lfu = np.int32(policy == "lfu")
        self.doorkeeper = np.int32(admission == "second-sight")
        # The fills above ran on CuPy's current stream; the cache's kernels may run on
        # another (torch's or JAX's, non-blocking): they must find the fills done.
        finish_current_stream()

    def _layout_args(self):
        layout = self.side.table.layout
        return (self.data, np.int64(self.width), np.int64(layout.dim),
                np.int64(layout.state_offset))

    def insert(self, plan, stream, protect_prev: bool = False):
        """The fused find/miss/admit/evict/fill pass over a planned batch: each run's slot
        (int32, -1 for rows served from the host)."""
        import cupy

        from xferlib._kernels.cache import (CACHE_INSERT, CACHE_MARK, CACHE_MODULE, CACHE_SETS,
                                           HOST_ARGS, LAYOUT_ARGS)
        from xferlib._kernels.table import c_type, key_type
        from xferlib.batch import sort_positions

        n = plan.n
        set_key = cupy.empty(n, dtype=np.int32)
        run_row = cupy.empty(n, dtype=np.int64)
        slots = cupy.empty(n, dtype=np.int32)
        grid_n, block_n = grid_1d(n, 256, 4096)
        CACHE_SETS.launch(CACHE_MODULE, (key_type(plan.keys.itemsize),), grid_n, block_n,
                          stream=stream, keys=plan.keys, run=plan.run, n=n, n_sets=self.n_sets,
                          n_rows=self.side.table.num_rows, **self.order_args, set_key=set_key,
                          run_row=run_row, tick=self.tick, verdict=plan.verdict.words)
        if self.set_order is not None:  # runs in key order are in set order
            sets, order = set_key, None
        else:
            # On the device (the default at every batch size): CuPy's argsort waits for the
            # device, which would stall every cached step's host side and break a capture.
            sets, order, _ = sort_positions(set_key, self.n_sets + 1, stream=stream)
        grid, block = self.side.launch_size(n)
        CACHE_INSERT.launch(
            CACHE_MODULE, (self.side.vec, c_type(self.side.dtype_name)), grid, block,
            stream=stream, **named(HOST_ARGS, self.side.host_args()),
            **named(LAYOUT_ARGS, self._layout_args()), tags=self.tags, score=self.score,
            last=self.last, dirty=self.dirty, door=self.door, door_bits=self.door_bits,
            sets=sets, order=order, run_row=run_row, n=n, n_sets=self.n_sets, slots=slots,
            tick=self.tick, lfu=self.lfu, doorkeeper=self.doorkeeper,
            protect_prev=protect_prev, stats=self.stats, verdict=plan.verdict.words)
        if self.doorkeeper:
            CACHE_MARK.launch(CACHE_MODULE, (), grid_n, block_n, stream=stream, door=self.door,
                              door_bits=self.door_bits, set_key=set_key, run_row=run_row,
                              slots=slots, n=n, n_sets=self.n_sets,
                              verdict=plan.verdict.words)
        return slots

    def probe(self, plan, stream):
        """Each run's current slot (-1: in host RAM), changing nothing."""
        import cupy

        from xferlib._kernels.cache import CACHE_MODULE, CACHE_PROBE
        from xferlib._kernels.table import key_type

        slots = cupy.empty(plan.n, dtype=np.int32)
        grid, block = self.side.launch_size(plan.n)
        CACHE_PROBE.launch(CACHE_MODULE, (key_type(plan.keys.itemsize),), grid, block,
                           stream=stream, tags=self.tags, n_sets=self.n_sets, keys=plan.keys,
                           run=plan.run, n=plan.n, n_rows=self.side.table.num_rows,
                           **self.order_args, slots=slots, verdict=plan.verdict.words)
        return slots

    def flush(self, stream, drop: bool) -> None:
        """Write dirty rows back to host RAM; ``drop``: empty the cache too."""
        from xferlib._kernels.cache import CACHE_FLUSH, CACHE_MODULE, HOST_ARGS, LAYOUT_ARGS
        from xferlib._kernels.table import c_type

        n_slots = self.tags.size
        grid, block = self.side.launch_size(n_slots)
        CACHE_FLUSH.launch(CACHE_MODULE, (self.side.vec, c_type(self.side.dtype_name)), grid,
                           block, stream=stream, **named(HOST_ARGS, self.side.host_args()),
                           **named(LAYOUT_ARGS, self._layout_args()), tags=self.tags,
                           score=self.score, last=self.last, dirty=self.dirty,
                           n_slots=n_slots, drop=drop)

    def read_stats(self) -> dict:
        values = self.stats.get().tolist()
        return dict(zip(("lookups", "hits", "misses", "admitted", "evicted"), values))

    def reset_stats(self) -> None:
        self.stats.fill(0)

    def cached_rows(self) -> np.ndarray:
        tags = self.tags.get()
        return np.sort(tags[tags >= 0])
