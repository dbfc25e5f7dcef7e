"""Lookups and pooled bags: the float64 references (the oracles of every test), the array path
(NumPy on the CPU, CuPy with batched cuBLAS products on the GPU, following the arrays it is
given) and the forward that hands GPU batches of a shape the kernels take to the batch plan.
"""

from __future__ import annotations

import numpy as np

from xferlib._backend import array_module, is_cupy_array
from xferlib.tt.plan import gpu_plan, uses_kernels
from xferlib.tt.shape import TTShape, check_out, checked_indices

__all__ = ["tt_rows", "tt_rows_reference", "tt_to_dense", "tt_embedding_bag",
           "tt_embedding_bag_reference", "tt_embedding_bag_fwd", "tt_bag_residuals"]


def tt_rows_reference(cores, shape: TTShape, idx) -> np.ndarray:
    """Rows ``idx`` of the table, float64, one explicit chain of slice products per row."""
    shape.check_cores(cores)
    digits = shape.digits(idx)
    out = np.empty((len(digits), shape.dim))
    slices = [shape.core_slices(np.asarray(c, dtype=np.float64), k) for k, c in enumerate(cores)]
    for n, row_digits in enumerate(digits):
        acc = np.ones((1, 1))  # (columns so far, rank)
        for k, i_k in enumerate(row_digits):
            g = slices[k][i_k]  # (R_k, q_k, R_{k+1})
            acc = np.einsum("ar,rjs->ajs", acc, g).reshape(-1, g.shape[2])
        out[n] = acc[:, 0]
    return out


def prefix_products(cores, shape: TTShape, digits, upto: int, dtype):
    """``(n, prod(q_1..q_upto), R_upto)``: the product of the first ``upto`` slices."""
    xp = array_module(digits)
    n = len(digits)
    acc = xp.ones((n, 1, 1), dtype=dtype)
    for k in range(upto):
        g = shape.core_slices(cores[k], k)[digits[:, k]].astype(dtype, copy=False)
        # (n, A, R) x (n, R, q S) as one batched matmul, then split q from S (sizes spelled
        # out: an empty batch cannot infer a -1)
        _, r, q, s = g.shape
        acc = xp.matmul(acc, g.reshape(n, r, q * s)).reshape(n, acc.shape[1] * q, s)
    return acc


def suffix_products(cores, shape: TTShape, digits, start: int, dtype):
    """``(n, R_start, prod(q_start..q_d))``: the product of slices ``start..d-1``."""
    xp = array_module(digits)
    n = len(digits)
    acc = xp.ones((n, 1, 1), dtype=dtype)
    for k in range(shape.d - 1, start - 1, -1):
        g = shape.core_slices(cores[k], k)[digits[:, k]].astype(dtype, copy=False)
        # (n, R q, S) x (n, S, B) as one batched matmul
        _, r, q, s = g.shape
        acc = xp.matmul(g.reshape(n, r * q, s), acc).reshape(n, r, q * acc.shape[2])
    return acc


def scatter_add(out, idx, values) -> None:
    """``out[idx] += values`` with repeated indices summed, on either namespace."""
    if is_cupy_array(out):
        import cupy

        cupy.add.at(out, idx, values)  # cupyx.scatter_add is deprecated for this
    else:
        np.add.at(out, idx, values)


def tt_rows(cores, shape: TTShape, idx) -> np.ndarray:
    """Rows ``idx`` of the table (float32), batched slice products."""
    shape.check_cores(cores)
    digits = shape.digits(checked_indices(idx, shape))
    return prefix_products(cores, shape, digits, shape.d, np.float32)[:, :, 0]


def tt_to_dense(cores, shape: TTShape) -> np.ndarray:
    """The whole table, ``(prod(p), prod(q))`` float32 (FBTT's ``tt_matrix_to_full``)."""
    return tt_rows(cores, shape, np.arange(shape.num_rows))


def _bag_ids(indices, offsets, include_last_offset: bool):
    """Bag of each lookup and the lookups per bag, from offsets (B+1 with the last), in the
    indices' namespace. The offsets are checked on the host (B + 1 numbers)."""
    xp = array_module(indices)
    host = np.asarray(offsets.get() if is_cupy_array(offsets) else offsets, dtype=np.int64)
    n = len(indices)
    if host.ndim != 1 or len(host) == 0:
        raise ValueError("offsets must be a non-empty 1-D array")
    bounds = host if include_last_offset else np.append(host, n)
    if bounds[0] != 0 or bounds[-1] != n or np.any(np.diff(bounds) < 0):
        raise ValueError(f"offsets must start at 0, not decrease, and end at {n} "
                         f"(include_last_offset={include_last_offset}); got {host.tolist()}")
    bounds = xp.asarray(bounds)
    bag = xp.searchsorted(bounds[1:], xp.arange(n), side="right")
    return bag, xp.diff(bounds)


def lookup_weights(counts, bag, per_sample_weights, mode, n, dtype):
    xp = array_module(bag)
    w = xp.ones(n, dtype=dtype) if per_sample_weights is None else xp.asarray(
        per_sample_weights, dtype=dtype)
    if w.shape != (n,):
        raise ValueError(f"per_sample_weights must have shape ({n},), got {w.shape}")
    if mode == "mean":
        w = w / xp.maximum(counts, 1)[bag]
    elif mode != "sum":
        raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
    return w


def tt_embedding_bag_reference(cores, shape: TTShape, indices, offsets, *, mode="sum",
                               per_sample_weights=None, include_last_offset=True):
    """Pooled bags in float64 from the dense rows: the oracle for :func:`tt_embedding_bag`."""
    indices = checked_indices(indices, shape)
    bag, counts = _bag_ids(indices, offsets, include_last_offset)
    w = lookup_weights(counts, bag, per_sample_weights, mode, len(indices), np.float64)
    rows = tt_rows_reference(cores, shape, indices) * w[:, None]
    out = np.zeros((len(counts), shape.dim))
    np.add.at(out, bag, rows)
    return out


def tt_bag_residuals(shape: TTShape, indices, offsets, *, mode="sum", per_sample_weights=None,
                     include_last_offset=True, num_embeddings=None):
    """What backward needs, checked: ``(indices, bag of each lookup, weight of each lookup,
    number of bags)``; for GPU indices of a shape the kernels take, a :class:`TTBagPlan`."""
    if uses_kernels(shape, indices):
        return gpu_plan(None, shape, indices, offsets, mode, per_sample_weights,
                        include_last_offset, True, num_embeddings)[1]
    indices = checked_indices(indices, shape, num_embeddings)
    bag, counts = _bag_ids(indices, offsets, include_last_offset)
    w = lookup_weights(counts, bag, per_sample_weights, mode, len(indices), np.float32)
    return indices, bag, w, len(counts)


def tt_embedding_bag_fwd(cores, shape: TTShape, indices, offsets, *, mode="sum",
                         per_sample_weights=None, include_last_offset=True, check=True,
                         num_embeddings=None, out=None, cache=None, cache_count=False,
                         report=None, stream=None, scratch=None):
    """``(bags, residuals)``: pooled rows ``(B, D)`` (float32) and what backward needs.

    GPU (CuPy) arrays run the CUDA kernels (see :class:`TTBagPlan`) on ``stream`` (default:
    CuPy's current stream); ``check=False`` there leaves the verdict on bad indices or
    offsets unread until backward or the plan's ``verdict.raise_now()`` (no host sync in the
    forward; the bags of a rejected batch are zeros and nothing is ever written outside
    them). NumPy arrays are checked at once.
    ``num_embeddings``: indices must be below it (default: every row of the factorization).
    ``out``: a ``(B, D)`` float32 array (of the cores' namespace) to write the bags into.
    ``cache``: a :class:`TTRowCache`; while it is active, lookups of its rows read its dense
    rows instead; ``cache_count`` also counts the lookups in its frequency table (on the GPU
    in ``tt_rows``, as it computes the rows; the cached slots are found in ``tt_prepare``).
    ``report``: GPU indices to name in an index
    error instead of ``indices`` (same length; for callers that map their indices).
    ``scratch``: a :class:`xferlib.tt.scratch.Scratch` of ``stream`` (GPU, not while a CUDA
    graph is captured): the call's working buffers come from it instead of the memory pool.
    """
    shape.check_cores(cores)
    if uses_kernels(shape, indices, cores):
        return gpu_plan(cores, shape, indices, offsets, mode, per_sample_weights,
                        include_last_offset, check, num_embeddings, out, cache, cache_count,
                        report, stream, scratch)
    indices, bag, w, num_bags = tt_bag_residuals(
        shape, indices, offsets, mode=mode, per_sample_weights=per_sample_weights,
        include_last_offset=include_last_offset, num_embeddings=num_embeddings)
    if out is not None:  # before the cache counts the batch
        check_out(out, num_bags, shape)
    rows = tt_rows(cores, shape, indices)
    if cache is not None and cache_count:
        cache.count(indices, stream=stream)
    if cache is not None and cache.active:
        slot = cache.slots(indices)
        xp = array_module(rows)
        rows = xp.where((slot >= 0)[:, None], cache.weight[xp.maximum(slot, 0)], rows)
    rows = rows * w[:, None]
    bags = array_module(rows).zeros((num_bags, shape.dim), dtype=np.float32)
    scatter_add(bags, bag, rows)
    if out is None:
        return bags, (indices, bag, w)
    out[...] = bags
    return out, (indices, bag, w)


def tt_embedding_bag(cores, shape, indices, offsets, **kwargs) -> np.ndarray:
    """Pooled TT rows per bag (sum or mean, optional per-sample weights), float32."""
    return tt_embedding_bag_fwd(cores, shape, indices, offsets, **kwargs)[0]


def to_host(a) -> np.ndarray:
    return a.get() if is_cupy_array(a) else np.asarray(a)
