"""The collection's NumPy path: checks, pooled lookup and fused update on host arrays.

What CPU users and CI run. Vectorized per table; sums run in batch order (``np.add.at`` is
unbuffered and in order), and repeated rows' gradients are summed in float64 by
``sum_duplicates``, so two runs give the same bits.
"""

from __future__ import annotations

import numpy as np

from xferlib.collection.reference import bag_ids
from xferlib.table.rules import update_rows

__all__ = ["check_entry_offsets", "check_inputs_numpy", "pooled_lookup_numpy",
           "update_numpy"]


def check_offsets(offsets: np.ndarray, num_indices: int) -> None:
    """FBGEMM's contract for bag boundaries: start at 0, never decrease, end at the number
    of indices. ValueError naming the first bad position."""
    if int(offsets[0]) != 0:
        raise ValueError(f"offsets[0] must be 0, got {int(offsets[0])}")
    down = np.flatnonzero(offsets[1:] < offsets[:-1])
    if down.size:
        k = int(down[0]) + 1
        raise ValueError(f"offsets must not decrease: offsets[{k}] = {int(offsets[k])} < "
                         f"offsets[{k - 1}] = {int(offsets[k - 1])}")
    if int(offsets[-1]) != num_indices:
        raise ValueError(f"offsets[-1] must equal the number of indices ({num_indices}), "
                         f"got {int(offsets[-1])}")


def check_entry_offsets(name: str, offsets, num_indices: int) -> None:
    """One table's offsets in the per-table dict form, read on the host: FBGEMM's contract
    (start at 0, never decrease, end at the table's number of indices). ValueError naming
    the table."""
    try:
        check_offsets(np.asarray(offsets), num_indices)
    except ValueError as err:
        raise ValueError(f"table {name!r}: {err}") from None


def table_error(coll, t: int, position: int, value: int) -> IndexError:
    n = coll.tables[t].num_rows
    return IndexError(f"index {value} at position {position} is out of range for table "
                      f"{coll.names[t]!r} of {n} rows (valid: 0 <= index < {n})")


def check_inputs_numpy(coll, indices: np.ndarray, offsets: np.ndarray) -> None:
    """Offsets and every index against its own table, before anything is read or written."""
    check_offsets(offsets, indices.shape[0])
    B = (offsets.shape[0] - 1) // coll.num_tables
    for t in range(coll.num_tables):
        lo, hi = int(offsets[t * B]), int(offsets[(t + 1) * B])
        mine = indices[lo:hi]
        bad = (mine < 0) | (mine >= coll.tables[t].num_rows)
        if bad.any():
            k = int(np.argmax(bad))
            raise table_error(coll, t, lo + k, int(mine[k]))


def _table_lookups(coll, offsets, per_sample_weights, B, t, num_indices):
    """Table ``t``'s lookups: ``(lo, hi, bag in 0..B-1, factor)``; factor None for plain
    sums."""
    lo, hi = int(offsets[t * B]), int(offsets[(t + 1) * B])
    local = np.asarray(offsets[t * B:(t + 1) * B + 1], dtype=np.int64) - lo
    bags = bag_ids(local, hi - lo)
    factor = None
    if per_sample_weights is not None:
        factor = np.asarray(per_sample_weights[lo:hi], dtype=coll.dtype)
    if coll.pooling == "mean":
        lengths = np.maximum(np.diff(local), 1).astype(coll.dtype)
        inv = (1 / lengths)[bags]
        factor = inv if factor is None else factor * inv
    return lo, hi, bags, factor


def pooled_lookup_numpy(coll, indices, offsets, per_sample_weights, B, out=None):
    if out is None:
        out = np.empty((B, coll.total_dim), coll.dtype)
    for t in range(coll.num_tables):
        if t in coll.tt_tables:  # pooled by its TT table (tt_tables.py)
            continue
        lo, hi, bags, factor = _table_lookups(coll, offsets, per_sample_weights, B, t,
                                              indices.shape[0])
        weights = coll.blocks[t].weights(coll.buffers[coll.tables[t].placement])
        rows = weights[indices[lo:hi]]
        if factor is not None:
            rows *= factor[:, None]
        pooled = np.zeros((B, coll.dims[t]), coll.dtype)
        np.add.at(pooled, bags, rows)
        out[:, coll.dim_offsets[t]:coll.dim_offsets[t + 1]] = pooled
    return out


def update_numpy(coll, ctx, grad_pooled) -> None:
    """Each hbm / host table's per-lookup gradients from the pooled gradient, then its rows'
    update."""
    indices, offsets = ctx.indices, ctx.offsets
    grad_pooled = np.asarray(grad_pooled, dtype=coll.dtype)
    for t in range(coll.num_tables):
        if t in coll.tt_tables:  # trained by its TT table (tt_tables.py)
            continue
        lo, hi, bags, factor = _table_lookups(coll, offsets, ctx.per_sample_weights,
                                              ctx.batch_size, t, indices.shape[0])
        if hi == lo:
            continue
        grads = grad_pooled[bags, coll.dim_offsets[t]:coll.dim_offsets[t + 1]]
        if factor is not None:
            grads = grads * factor[:, None]
        buffer = coll.buffers[coll.tables[t].placement]
        block = coll.blocks[t]
        update_rows(coll.rule, coll.hypers[t], block.layout, block.weights(buffer),
                    block.state(buffer), indices[lo:hi], grads)
