"""FBTT-Embedding's free names over xferlib's TT core: ``OptimType``, ``tt_matrix_to_full``,
``suggested_tt_shapes``, and the mapping of FBTT checkpoints onto xferlib's module.

``tt_matrix_to_full`` is torch ops on the cores' device, so gradients flow back to the cores
(FBTT's own tests differentiate through it).
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from xferlib import tt as core
from xferlib.tt.cache import insert_counts, key_slots

__all__ = ["OptimType", "tt_matrix_to_full", "suggested_tt_shapes"]


class OptimType(enum.Enum):
    """FBTT's optimizer names (the values are FBTT's strings)."""

    SGD = "sgd"
    EXACT_SGD = "exact_sgd"
    LAMB = "lamb"
    ADAGRAD = "adagrad"
    ADAM = "adam"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    LARS_SGD = "lars_sgd"
    PARTIAL_ROWWISE_ADAM = "partial_row_wise_adam"
    PARTIAL_ROWWISE_LAMB = "partial_row_wise_lamb"

    def __str__(self):
        return self.value


# Deterministic summation makes SGD and EXACT_SGD (and the Adagrad pair) the same update.
# ADAM keeps xferlib's row-wise Adam with a step count per row (see TTEmbeddingBag);
# PARTIAL_ROWWISE_ADAM is FBGEMM's (one global step).
CORE_OPTIMIZER = {
    OptimType.SGD: "sgd",
    OptimType.EXACT_SGD: "sgd",
    OptimType.ADAGRAD: "adagrad",
    OptimType.EXACT_ADAGRAD: "adagrad",
    OptimType.EXACT_ROWWISE_ADAGRAD: "rowwise_adagrad",
    OptimType.ADAM: "rowwise_adam",
    OptimType.LAMB: "lamb",
    OptimType.LARS_SGD: "lars_sgd",
    OptimType.PARTIAL_ROWWISE_ADAM: "partial_rowwise_adam",
    OptimType.PARTIAL_ROWWISE_LAMB: "partial_rowwise_lamb",
}


def suggested_tt_shapes(n: int, d: int = 3, allow_round_up: bool = True) -> list[int]:
    """FBTT's name for :func:`xferlib.tt.suggest_tt_shapes`: ``d`` balanced factors of ``n``
    (product >= ``n`` with ``allow_round_up``, else exactly ``n``). FBTT maximizes the factors'
    entropy over all partitions (with sympy and scipy); this greedy split is balanced too but
    may order or split some ``n`` differently, so pass explicit shapes to reproduce FBTT's.
    ``n`` and ``d`` are integers (a float raises TypeError).

    >>> suggested_tt_shapes(64, 3)
    [4, 4, 4]
    """
    return core.suggest_tt_shapes(n, d, allow_round_up)


def tt_matrix_to_full(tt_p_shapes, tt_q_shapes, tt_ranks, tt_cores, tt_permute=None):
    """The full ``(prod(p), prod(q))`` table from TT cores, as FBTT's function of this name:
    torch ops on the cores' device (differentiable, in the cores' dtype; FBTT casts to float32).

    ``tt_ranks`` may include the padding 1s or not. Axis ``i`` of a stored core holds the
    natural axis ``tt_permute[i]`` of ``(R_k, p_k, q_k, R_{k+1})`` (any permutation; FBTT's is
    right only for permutations that are their own inverse, such as its ``[1, 0, 2, 3]``).
    ``None``: cores already in the natural order, or FBTT's stored ``[1, p_k, R q R]`` layout.

    >>> cores = [torch.ones(1, 2, 3), torch.ones(1, 3, 1)]  # p = [2, 3], q = [3, 1], rank 1
    >>> tt_matrix_to_full([2, 3], [3, 1], [1], cores, [1, 0, 2, 3]).shape
    torch.Size([6, 3])
    """
    p, q = [int(v) for v in tt_p_shapes], [int(v) for v in tt_q_shapes]
    d = len(p)
    ranks = [int(r) for r in tt_ranks]
    if len(ranks) == d - 1:
        ranks = [1] + ranks + [1]
    if len(q) != d or len(ranks) != d + 1 or len(tt_cores) != d:
        raise ValueError(f"need len(tt_q_shapes) == len(tt_cores) == len(tt_p_shapes) = {d} and "
                         f"{d - 1} or {d + 1} ranks; got q={q}, ranks={list(tt_ranks)}, "
                         f"{len(tt_cores)} cores")
    if tt_permute is not None and sorted(tt_permute) != [0, 1, 2, 3]:
        raise ValueError(f"tt_permute must be a permutation of [0, 1, 2, 3], got {tt_permute}")
    natural = []
    for k, c in enumerate(tt_cores):
        c = torch.as_tensor(c)
        shape = (ranks[k], p[k], q[k], ranks[k + 1])
        permute = tt_permute
        if permute is None:
            permute = [0, 1, 2, 3] if tuple(c.shape) == shape else [1, 0, 2, 3]
        if c.numel() != int(np.prod(shape)):
            raise ValueError(f"core {k} has {c.numel()} values, not R p q R = {shape}")
        stored = c.reshape([shape[i] for i in permute])
        natural.append(stored.permute(*np.argsort(permute).tolist()))
    full = natural[0].reshape(p[0] * q[0], ranks[1])  # rows (i_0, j_0)
    for k in range(1, d):
        full = full @ natural[k].reshape(ranks[k], -1)  # (.., R_k) x (R_k, p q R)
        full = full.reshape(-1, ranks[k + 1])
    # axes (p_0, q_0, p_1, q_1, ...) -> (p_0, p_1, ..., q_0, q_1, ...)
    full = full.reshape([x for k in range(d) for x in (p[k], q[k])])
    full = full.permute(*range(0, 2 * d, 2), *range(1, 2 * d, 2))
    return full.reshape(int(np.prod(p)), int(np.prod(q)))


# ----------------------------------------------------------------------------- checkpoints


def fbtt_core_state(optimizer: str, value: torch.Tensor, expected: torch.Tensor):
    """A core's FBTT ``optimizer_state`` as this module's primary state, or None (ignored).

    FBTT keeps one float per core element for every optimizer but SGD (its fused kernel runs
    Adagrad for all of them): it maps onto Adagrad's sum directly and onto row-wise Adagrad
    as its row means (the row-wise sum of ``mean(g^2)``); other optimizers start fresh."""
    if optimizer == "adagrad" and value.shape == expected.shape:
        return value
    if optimizer == "rowwise_adagrad" and value.numel() == expected.numel() * value.shape[-1] \
            and value.dim() == expected.dim() + 1:
        return value.reshape(*expected.shape, -1).mean(-1)
    if optimizer == "sgd" and value.numel() == 0:
        return value.reshape(expected.shape)
    return None


def fbtt_cache(hashtbl, cache_freq, cache_state, cache_weight, cache_opt_state, optimizer):
    """FBTT's cache buffers (NumPy) as this module's: ``(hashtbl, cache_freq, cache_state,
    cache_rows, cache_weight, primary cache state or None)``. Rows are re-counted into this
    frequency table (its hash differs from FBTT's) and the cached rows sorted."""
    size, capacity = hashtbl.size, cache_weight.shape[0]
    seen = hashtbl >= 0
    keys = np.full(size, -1, dtype=np.int64)
    counts = np.zeros(size, dtype=np.int64)
    insert_counts(keys, counts, hashtbl[seen], cache_freq[seen])
    cached = seen & (cache_state >= 0) & (cache_state < capacity)
    rows, slots = hashtbl[cached], cache_state[cached].astype(np.int64)
    order = np.argsort(rows, kind="stable")[:capacity]
    rows, slots = rows[order], slots[order]
    cache_rows = np.full(capacity, core.NO_ROW, dtype=np.int64)
    cache_rows[:rows.size] = rows
    weight = np.zeros_like(cache_weight)
    weight[:rows.size] = cache_weight[slots]
    state = None
    if cache_opt_state is not None and optimizer in ("adagrad", "rowwise_adagrad"):
        wanted = 2 if optimizer == "adagrad" else 1
        if cache_opt_state.ndim == wanted and cache_opt_state.shape[0] == capacity:
            state = np.zeros_like(cache_opt_state)
            state[:rows.size] = cache_opt_state[slots]
    return keys, counts, key_slots(keys, rows), cache_rows, weight, state
