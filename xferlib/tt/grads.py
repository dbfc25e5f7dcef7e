"""Core gradients from bag gradients: the backward of the array path, the kernel path's
gradients grouped by core row (no dense table gradient), and :func:`tt_core_grads`, the first
half of a fused update for callers that sum gradients across processes."""

from __future__ import annotations

import math

import numpy as np

from xferlib._backend import array_module, as_cupy_stream
from xferlib._kernels import grid_1d, named
from xferlib._kernels.tt import (BWD_CACHE_ARGS, CHUNK, CORE_ARGS, REDUCE_SPLITS,
                                 REDUCE_THREADS, THREADS, TT_BWD_PIECES, TT_REDUCE,
                                 TT_REDUCE_JOIN)
from xferlib.tt.lookup import prefix_products, scatter_add, suffix_products
from xferlib.tt.plan import TTBagPlan, core_pointers, key_type, module_of, sort_keys
from xferlib.tt.shape import TTShape, grad_spans, lead_core, total_core_rows

__all__ = ["tt_embedding_bag_bwd", "tt_core_grads"]


def tt_embedding_bag_bwd(cores, shape: TTShape, residuals, grad_bags, *,
                         stream=None) -> list[np.ndarray]:
    """Gradients of the cores (float32, the cores' shapes) from ``(B, D)`` bag gradients.

    For lookup ``n`` with digits ``i``, the slice gradient of core ``k`` is
    ``sum_{a,b} Left[n, a, r] * g[n, a, j, b] * Right[n, s, b]``, with ``Left`` the product of
    the slices before ``k`` and ``Right`` of those after; rows of repeated digits add up.
    On the kernel path the work runs on ``stream`` (default: CuPy's current stream) and the
    batch's verdict is read (raised) once the gradients are queued.
    """
    if isinstance(residuals, TTBagPlan):
        stream = as_cupy_stream(stream)
        grad, _ = gpu_core_grads(cores, shape, residuals, grad_bags, dense=True, stream=stream)
        residuals.verdict.raise_now(stream)
        return [grad[start:stop].reshape(shape.core_shape(k))
                for k, (start, stop) in enumerate(grad_spans(shape))]
    indices, bag, w = residuals
    xp = array_module(indices)
    digits = shape.digits(indices)
    n = len(indices)
    g = xp.asarray(grad_bags, dtype=np.float32)[bag] * w[:, None]  # (n, D)
    grads = []
    q = shape.q_shapes
    for k in range(shape.d):
        left = prefix_products(cores, shape, digits, k, np.float32)  # (n, A, R_k)
        right = suffix_products(cores, shape, digits, k + 1, np.float32)  # (n, R_k+1, B)
        a, r_k, r_k1, b = left.shape[1], left.shape[2], right.shape[1], right.shape[2]
        # sum_a Left[n,a,r] g[n,a,(j,b)] -> (n, r, j, b); then sum_b (.)[n,r,j,b] Right[n,s,b]
        t = xp.matmul(left.transpose(0, 2, 1), g.reshape(n, a, q[k] * b))
        slice_grads = xp.matmul(t.reshape(n, r_k * q[k], b), right.transpose(0, 2, 1))
        slice_grads = slice_grads.reshape(n, r_k, q[k], r_k1)
        grad = xp.zeros((shape.p_shapes[k],) + slice_grads.shape[1:], dtype=np.float32)
        scatter_add(grad, digits[:, k], slice_grads)
        grads.append(grad.reshape(shape.core_shape(k)))
    return grads


# The fused update in two halves, for callers that combine the gradients of several
# processes (data parallelism) between them: the sum of every process's gradient applied
# once equals one fused update on the concatenated batch.


def tt_core_grads(cores, shape: TTShape, residuals, grad_bags, *, stream=None):
    """``(grad, touched)``: the first half of :func:`tt_fused_update`.

    ``grad``: every core's gradient in one flat float32 array (core ``k`` at offset
    ``sum(p_j * width_j for j < k)``, row-major), zeros in rows the batch did not touch;
    ``touched``: int32, one flag per core row (core ``k``'s rows from ``sum(p[:k])``), 1 where
    the batch touched it. Both are core-sized: no dense table gradient. Adding several batches'
    ``grad`` and taking the union (or sum) of their ``touched`` and handing them to
    :func:`tt_apply_core_grads` equals one :func:`tt_fused_update` on the concatenated batches
    (up to float summation order). On the kernel path (queued on ``stream``, default CuPy's
    current stream) a rejected batch gives zeros and touches nothing; its verdict is not read
    here (the plan's ``verdict.raise_now()`` reads it).

    >>> from xferlib.tt import TTShape, init_tt_cores, tt_embedding_bag_fwd
    >>> shape = TTShape([4, 5], [2, 2], [3])
    >>> cores = init_tt_cores(shape, "normal", rng=np.random.default_rng(0))
    >>> _, res = tt_embedding_bag_fwd(cores, shape, np.array([1, 7, 7]), np.array([0, 1, 3]))
    >>> grad, touched = tt_core_grads(cores, shape, res, np.ones((2, 4), np.float32))
    >>> grad.shape, touched.tolist()
    ((54,), [1, 1, 0, 0, 0, 1, 1, 0, 0])
    """
    total = total_core_rows(shape)
    if isinstance(residuals, TTBagPlan):
        stream = as_cupy_stream(stream)
        grad, touched = gpu_core_grads(cores, shape, residuals, grad_bags, dense=True,
                                       stream=stream)
        if touched is None:  # an empty batch
            with stream:
                touched = array_module(grad).zeros(total, dtype=np.int32)
        return grad, touched
    grads = tt_embedding_bag_bwd(cores, shape, residuals, grad_bags)
    xp = array_module(grads[0])
    digits = shape.digits(residuals[0])
    touched = xp.zeros(total, dtype=np.int32)
    start = 0
    for k in range(shape.d):
        touched[start + digits[:, k]] = 1
        start += shape.p_shapes[k]
    return xp.concatenate([g.reshape(-1) for g in grads]), touched


def gpu_core_grads(cores, shape: TTShape, plan: TTBagPlan, grad_bags, dense: bool, stream,
                   scratch=None, counter=None, cache_sums=None):
    """Each touched core row's gradient, in a flat buffer (zeros elsewhere when ``dense``,
    else untouched rows are left unwritten) and the flags of the touched rows (every one
    written), queued on ``stream`` (a CuPy stream). ``scratch`` (a
    :class:`xferlib.tt.scratch.Scratch` of ``stream``): every buffer comes from it, the
    returned gradient and flags included, so the caller must use them within the call.
    ``counter``: a one-element int64 device array the call adds 1 to before any update kernel
    queued after it runs (a fused step's counter; no launch of its own). ``cache_sums``:
    ``(slot, capacity, sums)`` of an active row cache (the plan's slots, the number of cached
    rows as an int64, an ``n x dim`` float32 array): the piece kernel also writes, at the last
    position of each run of a cached row within one of its blocks, that run's gradient sum
    into ``sums`` (what ``tt_update``'s cache blocks add up; no launch of its own)."""
    with stream:
        return _gpu_core_grads(cores, shape, plan, grad_bags, dense, stream, scratch, counter,
                               cache_sums)


def _gpu_core_grads(cores, shape, plan, grad_bags, dense, stream, scratch, counter,
                    cache_sums):
    import cupy

    n, d = plan.n, shape.d
    grad_bags = cupy.ascontiguousarray(cupy.asarray(grad_bags, dtype=np.float32))
    if grad_bags.shape != (plan.num_bags, shape.dim):
        raise ValueError(f"bag gradients must have shape {(plan.num_bags, shape.dim)}, got "
                         f"{grad_bags.shape}")
    size = grad_spans(shape)[-1][1]
    if n == 0:  # a rejected empty batch raises uncounted, as the kernels leave it
        plan.verdict.raise_now(stream)
        if counter is not None:
            counter += 1
        return (cupy.zeros(size, dtype=np.float32) if dense else None), None
    r = shape.padded_ranks
    a_last = math.prod(shape.q_shapes[:-1])
    if scratch is None:
        empty = lambda name, size, dtype: cupy.empty(size, dtype=dtype)  # noqa: E731
    else:
        scratch = scratch.named("grads.")
        empty = scratch.empty
    ubuf = empty("ubuf", n * a_last * r[d - 1], np.float32)
    cbuf = empty("cbuf", n * r[d - 1] * shape.q_shapes[-1], np.float32)
    c0buf = empty("c0buf", n * shape.core_shape(0)[1] if d > 2 else 1, np.float32)
    keys = empty("keys", (d - 1) * n, np.int32)
    key_name = key_type(plan.rows)
    weights = plan.per_sample_weights
    pointers = core_pointers(cores)
    module = module_of(shape)
    TT_BWD_PIECES.launch(
        module, (key_name,), grid_1d(n, CHUNK)[0], (THREADS,), stream=stream,
        **named(CORE_ARGS, pointers), rows=plan.rows, perm=plan.perm, n=n,
        bag_of=plan.bag_of, offsets=plan.offsets, n_off=plan.offsets.size,
        include_last=plan.include_last_offset, psw=weights, mean=plan.mean,
        grad_out=grad_bags, ubuf=ubuf, cbuf=cbuf, c0buf=c0buf, keys=keys,
        **named(BWD_CACHE_ARGS, cache_sums if cache_sums is not None else _NO_CACHE),
        verdict=plan.verdict.words)
    keyed = sum(shape.p_shapes) - shape.p_shapes[lead_core(shape)]
    # The keys are in range by construction (a rejected batch's are never read), so the
    # sort's words are not reset nor read.
    words = empty("words", 2, np.uint64)
    skeys, items = sort_keys(keys, keyed + 1, stream, words,
                             None if scratch is None else scratch.named("sort."), True)
    # tt_reduce writes every flag, and in a dense gradient every row: no memset
    grad = empty("grad", size, np.float32)
    touched = empty("touched", total_core_rows(shape), np.int32)
    # large batches: long lists of a core row summed by several blocks, joined in order
    splits = REDUCE_SPLITS if n >= _SPLIT_BATCH else 1
    part = empty("part", size * splits, np.float32) if splits > 1 else None
    TT_REDUCE.launch(module, (key_name,), (total_core_rows(shape) * splits,),
                     (REDUCE_THREADS,), stream=stream, **named(CORE_ARGS, pointers),
                     rows=plan.rows, n=n, skeys=skeys, items=items, n_items=keys.size,
                     ubuf=ubuf, cbuf=cbuf, c0buf=c0buf, grad=grad, touched=touched,
                     dense=dense, counter=counter, part=part, splits=splits,
                     verdict=plan.verdict.words)
    if part is not None:
        TT_REDUCE_JOIN.launch(module, (key_name,), (total_core_rows(shape),),
                              (REDUCE_THREADS,), stream=stream, rows=plan.rows, n=n,
                              skeys=skeys, n_items=keys.size, grad=grad, touched=touched,
                              part=part, splits=splits, verdict=plan.verdict.words)
    return grad, touched


_NULL = np.uint64(0)  # a NULL pointer argument
_NO_CACHE = [_NULL, np.int64(0), _NULL]  # tt_bwd_pieces' cache arguments without a cache
_SPLIT_BATCH = 1 << 15  # lookups from which tt_reduce splits long lists (see the kernel)
