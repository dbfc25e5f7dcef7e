"""The row cache of a TT table (:class:`TTRowCache`: hot rows held dense, FBTT-Embedding's
software cache), its frequency table, and each cached row's gradient (:func:`tt_cache_grad`)."""

from __future__ import annotations

import numpy as np

from xferlib._backend import array_module, as_cupy_stream
from xferlib._kernels import grid_1d
from xferlib._kernels.tt import TT_COUNT
from xferlib.tt.lookup import lookup_weights, scatter_add, to_host, tt_rows
from xferlib.tt.plan import TTBagPlan, module_of
from xferlib.tt.rules import row_state, state_pointers
from xferlib.tt.shape import TTShape

__all__ = ["NO_ROW", "TTRowCache", "tt_cache_grad"]


NO_ROW = np.iinfo(np.int64).max  # an empty cache slot: sorts after every row
_HASH = 0x9E3779B97F4A7C15  # Fibonacci hashing of row ids into the frequency table
_PROBES = 32  # open addressing: a row is counted within 32 slots of its hash, or not at all
# the module whose tt_count kernel counts lookups (that kernel does not depend on the shape)
_COUNT_SHAPE = TTShape((2, 2), (1, 1), (1,))


class TTRowCache:
    """Hot rows of a TT table held as dense rows (FBTT-Embedding's software cache).

    Arrays (NumPy or CuPy, where the cores are; fixed sizes, so framework views stay valid):
    ``rows`` (``capacity``, sorted ids, :data:`NO_ROW` in empty slots), ``weight``
    (``capacity x dim``), ``state`` (the sparse optimizer's state per cached row) and a
    frequency table ``freq_keys`` / ``freq_counts`` (``hashtbl_size`` slots, key -1 = empty;
    a row is counted in one of the 32 slots after its hash, or not at all when they are full,
    as FBTT's 32-way table does).

    ``key_slots`` (``hashtbl_size``, int32) is FBTT's ``cache_state``: the cache slot of each
    frequency-table entry's row, -1 where it is not cached. ``active`` (host flag): whether
    lookups read the cache at all; False until the first :meth:`populate` (FBTT's warmup).

    * :meth:`count` adds a batch's lookups to the frequencies (the module does it in training);
    * :meth:`populate` (explicit, as in FBTT) fills the cache with the most frequent rows:
      rows already cached keep their trained dense values and optimizer state, new ones start
      from their TT value with fresh state;
    * lookups of cached rows read the dense row; a training step updates it with the same
      optimizer, and **also** passes the lookup's gradient to the cores as if the row were not
      cached (write-through). So the cores learn from every lookup and nothing trained is lost
      when a row leaves the cache (:meth:`populate`, :meth:`reset`): what leaves is only the
      row's dense refinement, and the row reverts to its (trained) TT value.

    On the GPU kernel path the cache has no launch of its own: the lookups' slots and the
    counting run in the forward's row kernel, the cached rows' gradient sums in the backward's
    piece kernel and their optimizer step in the core update kernel (``xferlib/_kernels``).
    The arrays keep their identity for the cache's life (methods write them in place), so the
    kernel arguments built from them are built once.
    """

    def __init__(self, shape: TTShape, capacity: int, hashtbl_size: int, optimizer: str, xp=np):
        if capacity <= 0:
            raise ValueError(f"cache_size must be positive with use_cache=True, got {capacity}")
        if hashtbl_size < capacity:
            raise ValueError(f"hashtbl_size ({hashtbl_size}) must be at least cache_size "
                             f"({capacity})")
        self.shape, self.capacity, self.optimizer = shape, int(capacity), optimizer
        self.rows = xp.full(self.capacity, NO_ROW, dtype=np.int64)
        self.weight = xp.zeros((self.capacity, shape.dim), dtype=np.float32)
        self.state = row_state(self.capacity, shape.dim, optimizer, xp)
        self.freq_keys = xp.full(int(hashtbl_size), -1, dtype=np.int64)
        self.freq_counts = xp.zeros(int(hashtbl_size), dtype=np.int64)
        self.key_slots = xp.full(int(hashtbl_size), -1, dtype=np.int32)
        self.active = False
        self._args = {}

    @classmethod
    def from_arrays(cls, shape: TTShape, optimizer: str, *, rows, weight, state, freq_keys,
                    freq_counts, key_slots, active: bool) -> "TTRowCache":
        """A cache over existing arrays (a framework's tensors seen as NumPy/CuPy arrays)."""
        cache = cls.__new__(cls)
        cache.shape, cache.optimizer, cache.capacity = shape, optimizer, int(rows.shape[0])
        cache.rows, cache.weight, cache.state = rows, weight, dict(state)
        cache.freq_keys, cache.freq_counts = freq_keys, freq_counts
        cache.key_slots, cache.active = key_slots, bool(active)
        cache._args = {}
        return cache

    # The kernels' arguments (GPU), built once: the arrays never change identity.

    @property
    def capacity64(self):
        """``capacity`` as the kernels take it."""
        args = self._args.get("capacity")
        if args is None:
            args = self._args["capacity"] = np.int64(self.capacity)
        return args

    @property
    def freq_args(self) -> tuple:
        """The frequency table as the counting kernels take it: ``(keys, counts, size)``."""
        args = self._args.get("freq")
        if args is None:
            args = self._args["freq"] = (self.freq_keys, self.freq_counts,
                                         np.int64(self.freq_keys.size))
        return args

    def update_args(self, optimizer: str) -> list:
        """``tt_update``'s dense-row arguments: the rows and the optimizer's state pointers
        (``[weight, elementwise, second elementwise, per row, per-row steps]``)."""
        key = ("update", optimizer)
        args = self._args.get(key)
        if args is None:
            args = self._args[key] = [self.weight] + state_pointers(self.state, optimizer)
        return args

    def arrays(self) -> dict:
        """Every array of the cache by name (``state.<name>`` for the optimizer's)."""
        out = {"rows": self.rows, "weight": self.weight, "freq_keys": self.freq_keys,
               "freq_counts": self.freq_counts, "key_slots": self.key_slots}
        out.update({f"state.{k}": v for k, v in self.state.items()})
        return out

    def slots(self, indices):
        """Cache slot of each lookup (int64), -1 where the row is not cached. No host sync."""
        xp = array_module(self.rows)
        found, pos = _find_sorted(self.rows, xp.asarray(indices, dtype=np.int64))
        return xp.where(found, pos, -1)

    def count(self, indices, *, stream=None) -> None:
        """Add the lookups of ``indices`` (checked already) to the frequency table (on the GPU
        on ``stream``, default CuPy's current stream)."""
        xp = array_module(self.freq_keys)
        if xp is not np:
            stream = as_cupy_stream(stream)
            with stream:
                indices = xp.asarray(indices, dtype=np.int64)
                # the counting kernel does not depend on the shape: a small module's copy
                # serves shapes too large for the TT kernels as well
                TT_COUNT.launch(module_of(_COUNT_SHAPE), (), *grid_1d(indices.size, 256, 4096),
                                stream=stream, idx=indices, n=indices.size,
                                keys=self.freq_keys, counts=self.freq_counts,
                                size=self.freq_keys.size)
            return
        indices = xp.asarray(indices, dtype=np.int64)
        _count_host(self.freq_keys, self.freq_counts, indices)

    def populate(self, cores) -> None:
        """Cache the ``capacity`` most frequent rows (ties: the smaller id), keeping the dense
        values and state of rows already cached, from the cores' values for new ones."""
        self.populate_from(cores, to_host(self.freq_keys), to_host(self.freq_counts))

    def populate_from(self, cores, keys, counts) -> None:
        """:meth:`populate` from given access counts (host arrays: row ids, -1 ignored, and
        their counts; each id at most once), e.g. several processes' frequency tables summed.
        The frequency table itself is left as it is."""
        xp = array_module(self.rows)
        keys = np.asarray(keys, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        seen = keys >= 0
        keys, counts = keys[seen], counts[seen]
        order = np.lexsort((keys, -counts))[:self.capacity]
        chosen = np.sort(keys[order])
        kept, at = _find_sorted(to_host(self.rows), chosen)
        kept_slots, fresh = np.flatnonzero(kept), np.flatnonzero(~kept)
        weight = np.zeros((self.capacity, self.shape.dim), dtype=np.float32)
        weight[kept_slots] = to_host(self.weight)[at[kept]]
        state = {}
        for k, v in self.state.items():
            old = to_host(v)
            state[k] = np.zeros_like(old)
            state[k][kept_slots] = old[at[kept]]
        if fresh.size:
            weight[fresh] = to_host(tt_rows(cores, self.shape, xp.asarray(chosen[fresh])))
        rows = np.full(self.capacity, NO_ROW, dtype=np.int64)
        rows[:len(chosen)] = chosen
        self.rows[...] = xp.asarray(rows)
        self.key_slots[...] = xp.asarray(key_slots(to_host(self.freq_keys), chosen))
        self.active = True
        self.weight[...] = xp.asarray(weight)
        for k, v in self.state.items():
            v[...] = xp.asarray(state[k])

    def reset(self) -> None:
        """Empty the cache and forget the frequencies. The cores already hold every lookup's
        training (write-through), so rows simply revert to their TT values."""
        self.rows[...] = NO_ROW
        self.weight[...] = 0
        for v in self.state.values():
            v[...] = 0
        self.freq_keys[...] = -1
        self.freq_counts[...] = 0
        self.key_slots[...] = -1
        self.active = False

    def overlay(self, table) -> None:
        """Write the cached rows over a dense ``table`` (what the forward returns)."""
        rows = to_host(self.rows)
        used = rows != NO_ROW
        table[array_module(table).asarray(rows[used])] = self.weight[
            array_module(self.weight).asarray(np.flatnonzero(used))]


def _count_host(keys, counts, indices) -> None:
    """:meth:`TTRowCache.count` on NumPy arrays (see :func:`insert_counts`)."""
    rows, n = np.unique(np.asarray(indices, dtype=np.int64), return_counts=True)
    insert_counts(keys, counts, rows, n)


def insert_counts(keys, counts, rows, n) -> None:
    """Add ``n[i]`` accesses of distinct rows ``rows[i]`` to a frequency table, vectorized: in
    probe round ``j`` every row not yet placed tries slot ``home + j``; of rows that want one
    empty slot the smallest takes it (the GPU's atomics pick any)."""
    size = keys.size
    rows, n = np.asarray(rows, dtype=np.int64), np.asarray(n, dtype=np.int64)
    keep = rows >= 0
    rows, n = rows[keep], n[keep]
    home = ((rows.astype(np.uint64) * np.uint64(_HASH)) % np.uint64(size)).astype(np.int64)
    for probe in range(min(size, _PROBES)):
        if not rows.size:
            return
        slot = (home + probe) % size
        empty = keys[slot] == -1
        _, first = np.unique(slot[empty], return_index=True)
        claim = np.flatnonzero(empty)[first]
        keys[slot[claim]] = rows[claim]
        placed = keys[slot] == rows
        np.add.at(counts, slot[placed], n[placed])
        rows, n, home = rows[~placed], n[~placed], home[~placed]


def key_slots(freq_keys: np.ndarray, cached_rows: np.ndarray) -> np.ndarray:
    """FBTT's ``cache_state``: each frequency-table entry's cache slot, -1 if not cached."""
    out = np.full(freq_keys.size, -1, dtype=np.int32)
    if cached_rows.size:
        found, pos = _find_sorted(cached_rows, freq_keys)
        out[found & (freq_keys >= 0)] = pos[found & (freq_keys >= 0)]
    return out


def _find_sorted(sorted_rows, values):
    """``(found, position)`` of each value in a sorted array (same namespace; no host sync):
    ``sorted_rows[position] == value`` where found."""
    xp = array_module(sorted_rows)
    pos = xp.minimum(xp.searchsorted(sorted_rows, values), len(sorted_rows) - 1)
    return sorted_rows[pos] == values, pos


def tt_cache_grad(cache: TTRowCache, shape: TTShape, residuals, grad_bags):
    """``(grad, touched)``: each cache row's summed gradient (``capacity x dim``, zeros where
    not hit) and whether the batch hit it. On the GPU the sums go through atomic adds (their
    rounding depends on the order) and nothing waits for the device; on the CPU they run in
    batch order."""
    if isinstance(residuals, TTBagPlan):
        indices, bag, w = residuals.indices, residuals.bag_of, _plan_weights(residuals)
    else:
        indices, bag, w = residuals
    xp = array_module(indices)
    slot = cache.slots(indices)
    grad_bags = xp.asarray(grad_bags, dtype=np.float32)
    grad = xp.zeros((cache.capacity, shape.dim), dtype=np.float32)
    if xp is np:
        hits = np.flatnonzero(slot >= 0)
        scatter_add(grad, slot[hits], grad_bags[bag[hits]] * w[hits][:, None])
        touched = np.zeros(cache.capacity, dtype=bool)
        touched[slot[hits]] = True
        return grad, touched
    # every lookup, misses adding exact zeros to slot 0 (selected, not multiplied: a miss's
    # inf or NaN gradient stays out): no compaction, so no host sync for its size
    hit = slot >= 0
    at = xp.where(hit, slot, 0)
    scatter_add(grad, at, xp.where(hit[:, None], grad_bags[bag] * w[:, None],
                                    np.float32(0)))
    hits = xp.zeros(cache.capacity, dtype=np.int32)
    scatter_add(hits, at, hit.astype(np.int32))
    return grad, hits > 0


def _plan_weights(plan):
    """Each lookup's pooling weight on the kernel path (as the NumPy path computes it)."""
    xp = array_module(plan.bag_of)
    bounds = plan.offsets if plan.include_last_offset else xp.concatenate(
        [plan.offsets, xp.asarray([plan.n], dtype=np.int64)])
    return lookup_weights(xp.diff(bounds), plan.bag_of, plan.per_sample_weights,
                          "mean" if plan.mean else "sum", plan.n, np.float32).astype(
        np.float32, copy=False)
