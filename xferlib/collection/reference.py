"""The float64 references of a collection's pooled lookup and of its training step.

Loop-free where NumPy allows, readable, no performance work: the oracle every backend of
:class:`~xferlib.collection.EmbeddingCollection` is tested against.

The input is FBGEMM's layout: ``indices`` (every lookup of every table, table-major, then
bag-major), ``offsets`` (``T * B + 1`` bag boundaries into ``indices``; bag ``b`` of table
``t`` is ``indices[offsets[t * B + b]:offsets[t * B + b + 1]]``) and optional
``per_sample_weights`` (one per lookup). The pooled output is ``(B, sum of widths)``, table
``t``'s columns at ``sum(dims[:t])``.
"""

from __future__ import annotations

import numpy as np

from xferlib.table.rules import sparse_update_reference

__all__ = ["pooled_lookup_reference", "lookup_gradients_reference",
           "collection_step_reference", "bag_ids"]


def bag_ids(offsets, num_lookups: int) -> np.ndarray:
    """The bag (``t * B + b``) of every lookup, from the bag boundaries ``offsets``."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    return np.repeat(np.arange(lengths.size), lengths)[:num_lookups]


def _lookup_scales(offsets, per_sample_weights, pooling, n):
    """Each lookup's factor in its bag's sum: its sample weight, over the bag's length for
    mean pooling."""
    bags = bag_ids(offsets, n)
    scale = (np.ones(n) if per_sample_weights is None
             else np.asarray(per_sample_weights, dtype=np.float64))
    if pooling == "mean":
        lengths = np.diff(np.asarray(offsets, dtype=np.int64))
        scale = scale / np.maximum(lengths[bags], 1)
    return bags, scale


def pooled_lookup_reference(weights, indices, offsets, per_sample_weights=None,
                            pooling="sum") -> np.ndarray:
    """``(B, sum of widths)`` float64: each bag's rows times their weights, summed (over the
    bag's length for ``mean``; an empty bag pools to zeros). ``weights``: one
    ``(num_rows, dim)`` array per table."""
    T = len(weights)
    indices = np.asarray(indices, dtype=np.int64)
    B = (len(offsets) - 1) // T
    bags, scale = _lookup_scales(offsets, per_sample_weights, pooling, indices.size)
    columns = []
    for t, w in enumerate(weights):
        mine = (bags // B) == t
        rows = np.asarray(w, dtype=np.float64)[indices[mine]] * scale[mine, None]
        pooled = np.zeros((B, w.shape[1]))
        np.add.at(pooled, bags[mine] % B, rows)
        columns.append(pooled)
    return np.concatenate(columns, axis=1)


def lookup_gradients_reference(dims, indices, offsets, grad_pooled, per_sample_weights=None,
                               pooling="sum"):
    """Per table ``t``: ``(rows, grads)``, the table's looked-up rows and the gradient each
    lookup receives from ``grad_pooled`` (its bag's columns of table ``t`` times its factor),
    in batch order, float64."""
    T = len(dims)
    indices = np.asarray(indices, dtype=np.int64)
    grad_pooled = np.asarray(grad_pooled, dtype=np.float64)
    B = (len(offsets) - 1) // T
    bags, scale = _lookup_scales(offsets, per_sample_weights, pooling, indices.size)
    starts = np.concatenate([[0], np.cumsum(dims)])
    out = []
    for t in range(T):
        mine = (bags // B) == t
        g = grad_pooled[bags[mine] % B, starts[t]:starts[t + 1]] * scale[mine, None]
        out.append((indices[mine], g))
    return out


def collection_step_reference(optimizer, hypers, weights, states, steps, indices, offsets,
                              grad_pooled, per_sample_weights=None, pooling="sum"):
    """One training step of a collection in float64: every looked-up row receives its
    lookups' gradients (repeated rows summed) and ``optimizer`` runs on each touched row
    once, with table ``t``'s hyperparameters ``hypers[t]`` (lazy semantics, as
    :func:`xferlib.sparse_update_reference`). Returns ``(weights, states, steps)``, lists
    per table."""
    dims = [np.shape(w)[1] for w in weights]
    grads = lookup_gradients_reference(dims, indices, offsets, grad_pooled,
                                       per_sample_weights, pooling)
    new = [sparse_update_reference(optimizer, w, s, st, rows, g, h)
           for (rows, g), w, s, st, h in zip(grads, weights, states, steps, hypers)]
    return [n[0] for n in new], [n[1] for n in new], [n[2] for n in new]
