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
from xferlib._kernels import grid_1d
from xferlib._kernels.tt import CHUNK, THREADS
from xferlib.batch import NO_BAD, Verdict, host_values, sort_positions
from xferlib.perf import warn_tt_fallback
from xferlib.tt.shape import TTShape, check_index_array, check_out, lead_core

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
    """Residuals of the GPU kernel path: the batch sorted by row (``rows``, ``perm``), the
    bag of each lookup, its offsets and weights, the stream it was planned on, and the
    device verdict of the input check (a :class:`xferlib.batch.Verdict`: ``raise_now()``
    reads it, ``defer(queue)`` queues it)."""

    __slots__ = ("indices", "offsets", "include_last_offset", "per_sample_weights", "mean",
                 "rows", "perm", "bag_of", "verdict", "num_bags", "slot", "stream")

    def __init__(self, **fields):
        for name in self.__slots__:
            setattr(self, name, fields.get(name))

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


_FUNCTIONS = {}  # (device, shape, name) -> compiled kernel: a launch is one dict lookup


def _kernel(shape: TTShape, name: str):
    import cupy

    key = (cupy.cuda.runtime.getDevice(), shape, name)
    function = _FUNCTIONS.get(key)
    if function is None:
        from xferlib._kernels.tt import tt_module

        function = _FUNCTIONS[key] = tt_module(
            shape.p_shapes, shape.q_shapes, shape.ranks).get_function(name)
    return function


def launch(shape: TTShape, name: str, grid, block, args, stream) -> None:
    """Launch kernel ``name`` of ``shape``'s module on ``stream`` (a CuPy stream)."""
    _kernel(shape, name)(grid, block, tuple(args), stream=stream)


def sort_keys(keys, num_keys: int, stream, scratch=None, scratch_result=False):
    """``(sorted keys, positions, verdict words)``: a stable sort on ``stream``, no host
    sync (``scratch``: see ``xferlib.batch.sort_positions``)."""
    # Tile sorts and merges at every batch size: CuPy's argsort (Thrust) would wait for the
    # device, and a training step must not.
    return sort_positions(keys, num_keys, stream=stream, tiled_max=np.iinfo(np.int32).max,
                          scratch=scratch, scratch_result=scratch_result)


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
    bound = shape.num_rows if num_embeddings is None else int(num_embeddings)
    if scratch is not None:
        scratch = scratch.named("plan.")
    # the sorted rows and positions are the plan's (backward reads them): never scratch
    sort_scratch = None if scratch is None else scratch.named("sort.")
    if lead_core(shape) == 0:  # the sort key is the row
        rows, perm, sort_verdict = sort_keys(indices, bound, stream, sort_scratch)
    else:  # the lead core's digit first (xferlib/_kernels/tt.py); bad rows get a rejected key
        keys = (cupy.empty(n, dtype=np.int64) if scratch is None
                else scratch.empty("keys", n, np.int64))
        launch(shape, "tt_keys", *grid_1d(n, 256, 4096),
               (indices if indices.dtype == np.int64 else indices.astype(np.int64),
                np.int64(n), np.int64(bound), keys), stream)
        rows, perm, sort_verdict = sort_keys(keys, shape.num_rows, stream, sort_scratch)
    n_off = int(offsets.size)
    num_bags = n_off - 1 if include_last_offset else n_off
    verdict = Verdict.clean(TTReport(indices if report is None else report, offsets,
                                     include_last_offset, n, bound), stream)
    launch(shape, "tt_check_bags", *grid_1d(n_off + 1, 256, 1024),
           (offsets, np.int64(n_off), np.int32(include_last_offset), np.int64(n),
            sort_verdict, verdict.words), stream)
    y = None
    slot = None
    if cores is not None:
        # the slots first: tt_rows skips the lookups the cache serves
        if cache is not None and (cache.active or cache_count):
            slot = _cache_slots(cache, shape, indices, bound, cache_count, verdict.words, stream)
        y = (cupy.empty((n, shape.dim), dtype=np.float32) if scratch is None
             else scratch.empty("y", n * shape.dim, np.float32))
        launch(shape, f"tt_rows<{key_type(rows)}>", grid_1d(n, CHUNK)[0], (THREADS,),
               core_pointers(cores) + [rows, perm, np.int64(n), y,
                                       slot if slot is not None else np.uint64(0),
                                       np.int64(cache.capacity if slot is not None else 0),
                                       verdict.words], stream)
        if out is None:
            out = cupy.empty((num_bags, shape.dim), dtype=np.float32)
    else:
        out = None
    bag_of = cupy.empty(n, dtype=np.int64)
    total = num_bags * shape.dim
    launch(shape, "tt_pool", *grid_1d(total, 256, 65535),
           (y if y is not None else np.uint64(0), offsets, np.int64(n_off),
            np.int32(include_last_offset), np.int64(n),
            weights if weights is not None else np.uint64(0), np.int32(mode == "mean"),
            slot if slot is not None else np.uint64(0),
            cache.weight if slot is not None else np.uint64(0),
            np.int64(cache.capacity if slot is not None else 0),
            out if out is not None else np.uint64(0), bag_of, verdict.words), stream)
    plan = TTBagPlan(indices=indices, offsets=offsets, include_last_offset=include_last_offset,
                     per_sample_weights=weights, mean=mode == "mean", rows=rows, perm=perm,
                     bag_of=bag_of, verdict=verdict, num_bags=num_bags, slot=slot,
                     stream=stream)
    if check:
        verdict.raise_now(stream)
    return out, plan


def _cache_slots(cache, shape: TTShape, indices, bound: int, count: bool, words, stream):
    """One launch: each lookup's cache slot (-1: not cached; None while the cache is not
    active) and, with ``count``, the lookups added to the frequency table; nothing for a batch
    the verdict ``words`` reject."""
    import cupy

    n = int(indices.size)
    slot = cupy.empty(n, dtype=np.int64) if cache.active else None
    launch(shape, f"tt_cache_slots<{key_type(indices)}>", *grid_1d(n, 256, 4096),
           (indices, np.int64(n), np.int64(bound),
            cache.rows, np.int64(cache.capacity if cache.active else 0),
            cache.freq_keys if count else np.uint64(0), cache.freq_counts,
            np.int64(cache.freq_keys.size), slot if slot is not None else np.uint64(0),
            words), stream)
    return slot
