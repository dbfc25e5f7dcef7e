"""The kernel path's batch plan (xferlib/_kernels/tt.py): a batch sorted by row, rows sharing a
prefix computed from one prefix product, its bags pooled, and the device-side verdict of the
input check (:class:`TTBagPlan`, read by :func:`tt_check_plan` or a :class:`TTPendingCheck`).
Also which shapes the kernels take (their shared memory) and the launch helpers.
"""

from __future__ import annotations

import numpy as np

from xferlib._backend import is_cupy_array
from xferlib.perf import warn_tt_fallback
from xferlib.tt.shape import TTShape, check_index_array, check_out, lead_core

__all__ = ["TTBagPlan", "TTPendingCheck", "tt_check_plan"]


_KERNEL_SHARED_LIMIT = 48 * 1024  # static shared memory a kernel may use without opting in
_NO_BAD = np.iinfo(np.uint64).max


class TTBagPlan:
    """Residuals of the GPU kernel path: the batch sorted by row (``rows``, ``perm``), the
    bag of each lookup, its offsets and weights, and the device verdict of the input check
    (read once, by :func:`tt_check_plan`)."""

    __slots__ = ("indices", "offsets", "include_last_offset", "per_sample_weights", "mean",
                 "rows", "perm", "bag_of", "verdict", "num_bags", "checked", "bound", "slot",
                 "report")

    def __init__(self, **fields):
        for name in self.__slots__:
            setattr(self, name, fields.get(name))

    @property
    def n(self) -> int:
        return int(self.indices.size)


def uses_kernels(shape: TTShape, indices, cores=None) -> bool:
    """GPU arrays and a shape whose products fit the kernels' shared memory."""
    if not is_cupy_array(indices) or (cores is not None and not all(
            is_cupy_array(c) and c.dtype == np.float32 for c in cores)):
        return False
    from xferlib._kernels.tt import shared_bytes

    need = max(shared_bytes(shape.p_shapes, shape.q_shapes, shape.ranks).values())
    if need <= _KERNEL_SHARED_LIMIT:
        return True
    warn_tt_fallback((tuple(shape.p_shapes), tuple(shape.q_shapes), tuple(shape.ranks)),
                     f"its slice products need {need} bytes of shared memory, more than the "
                     f"kernels' {_KERNEL_SHARED_LIMIT}")
    return False


def _kernel(shape: TTShape, name: str):
    from xferlib._kernels.tt import tt_module

    return tt_module(shape.p_shapes, shape.q_shapes, shape.ranks).get_function(name)


def launch(shape: TTShape, name: str, grid, block, args) -> None:
    import cupy

    _kernel(shape, name)(grid, block, tuple(args), stream=cupy.cuda.get_current_stream())


def sort_positions(keys, num_keys: int):
    """``(sorted keys, positions, verdict)``: a stable sort on the device, no host sync."""
    import cupy

    from xferlib.rows import sorted_positions

    # Tile sorts and merges at every batch size: CuPy's argsort (Thrust) would wait for the
    # device, and a training step must not.
    return sorted_positions(keys, num_keys, cupy.cuda.get_current_stream(),
                            tiled_max=np.iinfo(np.int32).max)


def _clean_verdict():
    """Two device words set to all ones (no bad position found yet)."""
    import cupy

    verdict = cupy.empty(2, dtype=np.uint64)
    verdict.data.memset_async(0xFF, 16, cupy.cuda.get_current_stream())
    return verdict


def key_type(rows) -> str:
    return "int" if rows.dtype == np.int32 else "long long"


def core_pointers(cores) -> list:
    return list(cores) + [np.uint64(0)] * (4 - len(cores))


def gpu_plan(cores, shape: TTShape, indices, offsets, mode, per_sample_weights,
             include_last_offset, check, num_embeddings=None, out=None, cache=None,
             cache_count=False, report=None):
    """Sort and check the batch and (with ``cores``) pool its rows: ``(bags or None, plan)``."""
    import cupy

    from xferlib._kernels.tt import CHUNK, THREADS

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
    if lead_core(shape) == 0:  # the sort key is the row
        rows, perm, sort_verdict = sort_positions(indices, bound)
    else:  # the lead core's digit first (xferlib/_kernels/tt.py); bad rows get a rejected key
        keys = cupy.empty(n, dtype=np.int64)
        launch(shape, "tt_keys", (max(1, min(4096, -(-n // 256))),), (256,),
               (indices if indices.dtype == np.int64 else indices.astype(np.int64),
                np.int64(n), np.int64(bound), keys))
        rows, perm, sort_verdict = sort_positions(keys, shape.num_rows)
    verdict = _clean_verdict()
    n_off = int(offsets.size)
    num_bags = n_off - 1 if include_last_offset else n_off
    launch(shape, "tt_check_bags", (max(1, min(1024, -(-(n_off + 1) // 256))),), (256,),
           (offsets, np.int64(n_off), np.int32(include_last_offset), np.int64(n),
            sort_verdict, verdict))
    y = None
    if cores is not None:
        y = cupy.empty((n, shape.dim), dtype=np.float32)
        launch(shape, f"tt_rows<{key_type(rows)}>", (max(1, -(-n // CHUNK)),), (THREADS,),
               core_pointers(cores) + [rows, perm, np.int64(n), y, verdict])
        if out is None:
            out = cupy.empty((num_bags, shape.dim), dtype=np.float32)
    else:
        out = None
    bag_of = cupy.empty(n, dtype=np.int64)
    total = num_bags * shape.dim
    slot = None
    if cache is not None and y is not None and (cache.active or cache_count):
        slot = _cache_slots(cache, shape, indices, bound, cache_count)
    launch(shape, "tt_pool", (max(1, min(65535, -(-total // 256))),), (256,),
           (y if y is not None else np.uint64(0), offsets, np.int64(n_off),
            np.int32(include_last_offset), np.int64(n),
            weights if weights is not None else np.uint64(0), np.int32(mode == "mean"),
            slot if slot is not None else np.uint64(0),
            cache.weight if slot is not None else np.uint64(0),
            np.int64(cache.capacity if slot is not None else 0),
            out if out is not None else np.uint64(0), bag_of, verdict))
    plan = TTBagPlan(indices=indices, offsets=offsets, include_last_offset=include_last_offset,
                     per_sample_weights=weights, mean=mode == "mean", rows=rows, perm=perm,
                     bag_of=bag_of, verdict=verdict, num_bags=num_bags, checked=False,
                     bound=bound, slot=slot, report=report)
    if check:
        tt_check_plan(plan, shape)
    return out, plan


class TTPendingCheck:
    """The input check of a kernel-path batch, copied to the host asynchronously (pinned
    memory, an event on the stream): :meth:`resolve` waits for that copy only (by then usually
    long done) and raises as :func:`tt_check_plan` would."""

    def __init__(self, plan: TTBagPlan, shape: TTShape):
        import cupy
        import cupyx

        self.plan, self.shape = plan, shape
        self.host = cupyx.empty_pinned(2, dtype=np.uint64)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(self.host.ctypes.data, plan.verdict.data.ptr, 16,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self.event = cupy.cuda.Event(block=False, disable_timing=True)
        self.event.record(stream)

    @property
    def ready(self) -> bool:
        """Whether the verdict has arrived (resolve() would not wait)."""
        return self.event.done

    def resolve(self) -> None:
        self.event.synchronize()
        if (self.host != _NO_BAD).any():
            tt_check_plan(self.plan, self.shape)
        self.plan.checked = True


def tt_check_plan(plan: TTBagPlan, shape: TTShape) -> None:
    """Read a kernel-path batch's verdict (one 16-byte copy, a stream sync; once per plan) and
    raise IndexError for an index outside the table or ValueError for bad offsets."""
    if plan.checked:
        return
    bad_index, bad_offset = (int(v) for v in plan.verdict.get())
    if bad_index != _NO_BAD:
        shown = plan.indices if plan.report is None else plan.report
        value = int(shown[bad_index:bad_index + 1].get()[0])
        raise IndexError(f"index {value} at position {bad_index} is out of range for a TT "
                         f"table of {plan.bound} rows (valid: 0 <= index < {plan.bound})")
    if bad_offset != _NO_BAD:
        raise ValueError(f"offsets must start at 0, not decrease, and end at {plan.n} "
                         f"(include_last_offset={plan.include_last_offset}); got "
                         f"{plan.offsets.get().tolist()}")
    plan.checked = True


def _cache_slots(cache, shape: TTShape, indices, bound: int, count: bool):
    """One launch: each lookup's cache slot (-1: not cached; None while the cache is not
    active) and, with ``count``, the lookups added to the frequency table."""
    import cupy

    n = int(indices.size)
    slot = cupy.empty(n, dtype=np.int64) if cache.active else None
    launch(shape, f"tt_cache_slots<{key_type(indices)}>", (max(1, min(4096, -(-n // 256))),),
           (256,), (indices, np.int64(n), np.int64(bound),
                    cache.rows, np.int64(cache.capacity if cache.active else 0),
                    cache.freq_keys if count else np.uint64(0), cache.freq_counts,
                    np.int64(cache.freq_keys.size), slot if slot is not None else np.uint64(0)))
    return slot
