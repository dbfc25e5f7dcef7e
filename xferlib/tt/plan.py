"""The kernel path's batch plan (xferlib/_kernels/tt.py): a batch sorted by row, rows sharing a
prefix computed from one prefix product, its bags pooled, and the device-side verdict of the
input check (:class:`TTBagPlan`; its ``verdict`` is a :class:`xferlib.batch.Verdict`, read by
``raise_now()`` or deferred to a module's :class:`~xferlib.batch.PendingChecks`). Also which
shapes the kernels take (their shared memory) and the launch helpers.
"""

from __future__ import annotations

import functools

import numpy as np

from xferlib._backend import as_cupy_stream, is_cupy_array
from xferlib._kernels import grid_1d, named
from xferlib._kernels.radix import RADIX_MAX_N
from xferlib._kernels.tt import (CHUNK, CORE_ARGS, ROWS_CACHE_ARGS, THREADS, TT_POOL,
                                 TT_PREPARE, TT_ROWS)
from xferlib.batch import (NO_BAD, BatchPlan, Verdict, host_values, sort_buffers,
                           sort_on_device, sort_positions)
from xferlib.perf import warn_tt_fallback
from xferlib.tt.shape import TTShape, check_index_array, check_out, lead_core, row_bound

__all__ = ["TTBagPlan", "TTReport"]


_KERNEL_SHARED_LIMIT = 48 * 1024  # static shared memory a kernel may use without opting in


class TTReport:
    """Words a TT batch's verdict: word 0 is the first position whose index is out of range,
    word 1 flags bad offsets. ``shown``: the indices an error names (the caller's, where it
    mapped them); ``bound``: the table size it names."""

    __slots__ = ("shown", "offsets", "include_last_offset", "n", "bound")

    def __init__(self, shown, offsets, include_last_offset, n, bound):
        self.shown, self.offsets, self.include_last_offset = shown, offsets, include_last_offset
        self.n, self.bound = n, bound

    def __call__(self, bad_index: int, bad_offset: int) -> None:
        if bad_index != NO_BAD:
            value, = host_values(self.shown[bad_index:bad_index + 1])
            raise IndexError(f"index {value} at position {bad_index} is out of range for a TT "
                             f"table of {self.bound} rows (valid: 0 <= index < {self.bound})")
        raise ValueError(f"offsets must start at 0, not decrease, and end at {self.n} "
                         f"(include_last_offset={self.include_last_offset}); got "
                         f"{host_values(self.offsets)}")


class TTBagPlan:
    """Residuals of the GPU kernel path: the batch sorted by row (``batch``, the one
    :class:`xferlib.batch.BatchPlan`: its ``keys`` are ``rows``, with ``perm`` and the device
    verdict of the input check, a :class:`xferlib.batch.Verdict`: ``raise_now()`` reads it,
    ``defer(queue)`` queues it), the bag of each lookup, its offsets and weights, and the
    stream it was planned on."""

    __slots__ = ("indices", "offsets", "include_last_offset", "per_sample_weights", "mean",
                 "batch", "bag_of", "num_bags", "slot", "stream")

    def __init__(self, indices=None, offsets=None, include_last_offset=None,
                 per_sample_weights=None, mean=None, rows=None, perm=None, bag_of=None,
                 verdict=None, num_bags=None, slot=None, stream=None):
        self.indices, self.offsets, self.include_last_offset = indices, offsets, \
            include_last_offset
        self.per_sample_weights, self.mean = per_sample_weights, mean
        self.batch = BatchPlan(indices, rows, perm, verdict)
        self.bag_of, self.num_bags, self.slot, self.stream = bag_of, num_bags, slot, stream

    @property
    def rows(self):
        """The sorted rows (int32 or int64 keys; with three cores, keyed by the lead core)."""
        return self.batch.keys

    @property
    def perm(self):
        return self.batch.perm

    @property
    def verdict(self) -> Verdict:
        return self.batch.verdict

    @property
    def n(self) -> int:
        return int(self.indices.size)

    @property
    def checked(self) -> bool:
        """Whether the verdict was read and found clean."""
        return self.verdict.checked

    @property
    def bound(self) -> int:
        """The table size an index error names (callers that map their indices set it)."""
        return self.verdict.report.bound

    @bound.setter
    def bound(self, value: int) -> None:
        self.verdict.report.bound = int(value)

    def set_bound(self, value: int) -> None:
        """Name ``value`` as the table size in an index error (a caller that maps its
        indices, e.g. :class:`xferlib.tt.TTTable` onto its joint TT: the plan's fields are
        written by the plan's module)."""
        self.bound = value


def uses_kernels(shape: TTShape, indices, cores=None) -> bool:
    """GPU arrays and a shape whose products fit the kernels' shared memory."""
    if not is_cupy_array(indices) or (cores is not None and not all(
            is_cupy_array(c) and c.dtype == np.float32 for c in cores)):
        return False
    need = _shared_need(shape)
    if need <= _KERNEL_SHARED_LIMIT:
        return True
    warn_tt_fallback((tuple(shape.p_shapes), tuple(shape.q_shapes), tuple(shape.ranks)),
                     f"its slice products need {need} bytes of shared memory, more than the "
                     f"kernels' {_KERNEL_SHARED_LIMIT}")
    return False


@functools.lru_cache(maxsize=256)
def _shared_need(shape: TTShape) -> int:
    """The most static shared memory one of ``shape``'s kernels uses, in bytes."""
    from xferlib._kernels.tt import shared_bytes

    return max(shared_bytes(shape.p_shapes, shape.q_shapes, shape.ranks).values())


_MODULES = {}  # shape -> its kernel module: a launch finds it with one dict lookup


def module_of(shape: TTShape):
    """The kernel module compiled for ``shape`` (``xferlib/_kernels/tt.py``; its kernels are
    launched by name: ``TT_ROWS.launch(module_of(shape), (key,), grid, block, ...)``)."""
    module = _MODULES.get(shape)
    if module is None:
        from xferlib._kernels.tt import tt_module

        module = _MODULES[shape] = tt_module(shape.p_shapes, shape.q_shapes, shape.ranks)
    return module


def sort_keys(keys, num_keys: int, stream, words, scratch=None,
              scratch_result: bool = False, out=None):
    """``(sorted keys, positions)``: a stable sort of ``keys`` (all below ``num_keys``) on
    ``stream`` (a CuPy stream), no host sync (:func:`xferlib.batch.sort_on_device`: one
    tile-sort launch up to 2,048 keys, the radix sort past it). The first position of a
    key outside ``[0, num_keys)`` is reported by an atomic minimum into ``words[0]`` (two
    uint64 device words the caller set, or never reads: the sort does not reset them).
    ``scratch``, ``scratch_result``, ``out``: see :func:`xferlib.batch.sort_buffers` (the
    scratch a :class:`xferlib.tt.scratch.Scratch` of ``stream``; ``out`` of ``keys.size``
    elements, keys past int32 excepted)."""
    if num_keys > np.iinfo(np.int32).max or keys.size > RADIX_MAX_N:  # CuPy's sort (a sync)
        rows, perm, sort_words = sort_positions(keys, num_keys, stream=stream, tiled_max=0)
        words[:1] = sort_words[:1]
        return rows, perm

    return sort_on_device(keys, num_keys, stream, words,
                          sort_buffers(scratch, scratch_result, out))


_NULL = np.uint64(0)  # a NULL pointer argument


def _carve(*parts) -> list:
    """1-D arrays of ``(dtype, size)`` each, views of ONE new allocation (one pool request,
    where an array each costs one apiece); 8-byte dtypes first keep every part aligned."""
    import cupy

    sizes = [np.dtype(dtype).itemsize * size for dtype, size in parts]
    base = cupy.empty(max(sum(sizes), 1), dtype=np.uint8)
    views, offset = [], 0
    for (dtype, size), nbytes in zip(parts, sizes):
        views.append(cupy.ndarray((size,), dtype=dtype, memptr=base.data + offset))
        offset += nbytes
    return views


def key_type(rows) -> str:
    return "int" if rows.dtype == np.int32 else "long long"


def core_pointers(cores) -> list:
    return list(cores) + [np.uint64(0)] * (4 - len(cores))


def gpu_plan(cores, shape: TTShape, indices, offsets, mode, per_sample_weights,
             include_last_offset, check, num_embeddings=None, out=None, cache=None,
             cache_count=False, report=None, stream=None, scratch=None):
    """Sort and check the batch and (with ``cores``) pool its rows, on ``stream``:
    ``(bags or None, plan)``. ``scratch``: a :class:`xferlib.tt.scratch.Scratch` of
    ``stream`` for the buffers that live only within this call."""
    stream = as_cupy_stream(stream)
    with stream:
        return _gpu_plan(cores, shape, indices, offsets, mode, per_sample_weights,
                         include_last_offset, check, num_embeddings, out, cache, cache_count,
                         report, stream, scratch)


def _gpu_plan(cores, shape, indices, offsets, mode, per_sample_weights, include_last_offset,
              check, num_embeddings, out, cache, cache_count, report, stream, scratch):
    import cupy

    check_index_array(indices)
    offsets = cupy.asarray(offsets)
    if offsets.ndim != 1 or offsets.size == 0 or offsets.dtype.kind not in "iu":
        raise ValueError("offsets must be a non-empty 1-D integer array")
    if mode not in ("sum", "mean"):
        raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
    n = int(indices.size)
    num_bags = offsets.size - 1 if include_last_offset else offsets.size
    if out is not None:
        check_out(out, num_bags, shape)
        if not (is_cupy_array(out) and out.flags.c_contiguous):
            raise ValueError("out must be a C-contiguous CuPy array on the kernel path")
    weights = None
    if per_sample_weights is not None:
        weights = cupy.ascontiguousarray(cupy.asarray(per_sample_weights, dtype=np.float32))
        if weights.shape != (n,):
            raise ValueError(f"per_sample_weights must have shape ({n},), got {weights.shape}")
    if indices.dtype not in (np.int32, np.int64):
        indices = indices.astype(np.int64)
    indices = cupy.ascontiguousarray(indices)
    offsets = cupy.ascontiguousarray(offsets.astype(np.int64, copy=False))
    bound = row_bound(shape, num_embeddings)
    top_scratch = scratch
    if scratch is not None:
        scratch = scratch.named("plan.")
    n_off = int(offsets.size)
    num_bags = n_off - 1 if include_last_offset else n_off
    # What the plan keeps (backward and the deferred check read it, so never scratch): the
    # sorted positions, each lookup's bag, its cache slot (an active cache only), the
    # verdict's words and the sorted keys, carved from one allocation. tt_prepare sets the
    # words clean (no memset) and checks the offsets; the sort adds the first bad index.
    lookup = cores is not None and cache is not None and cache.active
    perm, bag_of, slot, words, sorted_keys = _carve(
        (np.int64, n), (np.int64, n), (np.int64, n if lookup else 0), (np.uint64, 2),
        (np.int32, n))
    verdict = Verdict(words, TTReport(indices if report is None else report, offsets,
                                      include_last_offset, n, bound))
    lead = lead_core(shape) != 0  # the lead core's digit first (xferlib/_kernels/tt.py)
    # tt_prepare reads the indices (as int64) for the sort keys and the cache slots
    wide = (indices if indices.dtype == np.int64 or not (lead or lookup)
            else indices.astype(np.int64))
    if lead:
        keys = (cupy.empty(n, dtype=np.int64) if scratch is None
                else scratch.empty("keys", n, np.int64))
    module = module_of(shape)
    TT_PREPARE.launch(module, (), *grid_1d(n, 256, 4096), stream=stream, idx=wide, n=n,
                      bound=bound, keys=keys if lead else None, offsets=offsets, n_off=n_off,
                      include_last=include_last_offset, crow=cache.rows if lookup else None,
                      capacity=cache.capacity64 if lookup else 0,
                      slot=slot if lookup else None, verdict=words)
    # the sort's working buffers (its result is the plan's: carved above)
    sort_scratch = None if scratch is None else scratch.named("sort.")
    result = sorted_keys, perm
    if lead:  # bad rows got a key the sort rejects
        rows, perm = sort_keys(keys, shape.num_rows, stream, words, sort_scratch,
                               out=result)
    else:  # the sort key is the row
        rows, perm = sort_keys(indices, bound, stream, words, sort_scratch, out=result)
    y = None
    if not lookup:
        slot = None
    if cores is not None:
        y = (cupy.empty((n, shape.dim), dtype=np.float32) if scratch is None
             else rows_scratch(top_scratch, n, shape.dim))
        # the row cache rides in tt_prepare (slots), tt_rows (skips, counting) and tt_pool
        # (its dense rows)
        TT_ROWS.launch(module, (key_type(rows),), grid_1d(n, CHUNK)[0], (THREADS,),
                       stream=stream, **named(CORE_ARGS, core_pointers(cores)), rows=rows,
                       perm=perm, n=n, y=y,
                       **named(ROWS_CACHE_ARGS, _cache_row_args(
                           cache, slot if lookup else None, cache is not None and cache_count)),
                       verdict=verdict.words)
        if out is None:
            out = cupy.empty((num_bags, shape.dim), dtype=np.float32)
    else:
        out = None
    total = num_bags * shape.dim
    TT_POOL.launch(module, (), *grid_1d(total, 256, 65535), stream=stream, y=y,
                   offsets=offsets, n_off=n_off, include_last=include_last_offset, n=n,
                   psw=weights, mean=mode == "mean", slot=slot if lookup else None,
                   cache_w=cache.weight if lookup else None,
                   cache_rows=cache.capacity64 if lookup else 0, out=out, bag_of=bag_of,
                   verdict=verdict.words)
    plan = TTBagPlan(indices=indices, offsets=offsets, include_last_offset=include_last_offset,
                     per_sample_weights=weights, mean=mode == "mean", rows=rows, perm=perm,
                     bag_of=bag_of, verdict=verdict, num_bags=num_bags, slot=slot,
                     stream=stream)
    if check:
        verdict.raise_now(stream)
    return out, plan


def rows_scratch(scratch, n: int, dim: int):
    """The forward's row buffer (``n x dim`` float32) from a step's top-level scratch: the
    backward of a cached step reuses it for the cached runs' gradient sums (each call's use
    ends within the call, and calls on one stream run in order)."""
    return scratch.named("plan.").empty("y", n * dim, np.float32)


_ZERO = np.int64(0)
_NO_CACHE = [_NULL, _ZERO, _NULL, _NULL, _ZERO]


def _cache_row_args(cache, slot, count: bool) -> list:
    """``tt_rows``' cache arguments: the lookups' slots and the number of cached rows (an
    active cache) and the frequency table (with ``count``), NULL / 0 otherwise."""
    if cache is None or not (slot is not None or count):
        return _NO_CACHE
    lookup = [slot, cache.capacity64] if slot is not None else [_NULL, _ZERO]
    return lookup + (list(cache.freq_args) if count else [_NULL, _NULL, _ZERO])
