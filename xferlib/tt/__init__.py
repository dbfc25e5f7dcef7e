"""Tensor-Train (TT) embedding tables: shapes, initializers, lookups and gradients (NumPy).

A table of ``prod(p_shapes)`` rows of ``prod(q_shapes)`` columns is stored as ``d`` cores
(2 <= d <= 4). Core ``k`` has shape ``(p_k, R_k * q_k * R_{k+1})``: row ``i_k`` of it is an
``R_k x q_k x R_{k+1}`` slice, in that order, with ``R_0 = R_d = 1`` (FBTT-Embedding's layout,
without its leading table axis). Row ``i`` of the table splits into digits
``(i_1, ..., i_d)``, most significant first (``i = sum_k i_k * prod(p_{k+1:})``), and is the
product of the slices ``G_1[i_1] G_2[i_2] ... G_d[i_d]``, flattened with ``q_1`` most
significant. Only the requested rows are ever rebuilt.

This module holds the float64 references and the vectorized array path, which runs on NumPy
arrays (CPU) and on CuPy arrays (GPU, batched products through cuBLAS), following the arrays
it is given; the framework adapters build on it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from xferlib._backend import array_module, is_cupy_array
from xferlib.optim.rules import OptId
from xferlib.perf import warn_tt_fallback

__all__ = [
    "TTShape",
    "suggest_tt_shapes",
    "init_tt_cores",
    "tt_rows",
    "tt_rows_reference",
    "tt_to_dense",
    "tt_from_dense",
    "tt_embedding_bag",
    "tt_embedding_bag_reference",
    "tt_embedding_bag_fwd",
    "tt_embedding_bag_bwd",
    "tt_bag_residuals",
    "tt_sparse_state",
    "tt_sparse_update",
    "tt_fused_update",
    "tt_core_grads",
    "tt_apply_core_grads",
    "tt_cache_apply",
    "tt_check_plan",
    "TTBagPlan",
    "TTPendingCheck",
    "TTRowCache",
    "tt_cache_grad",
    "NO_ROW",
    "SPARSE_OPTIMIZERS",
]


@dataclasses.dataclass(frozen=True)
class TTShape:
    """The factorization of a TT table. ``ranks`` are the inner ranks (``d - 1`` of them)."""

    p_shapes: tuple
    q_shapes: tuple
    ranks: tuple

    def __post_init__(self):
        p, q, r = (tuple(int(v) for v in x) for x in (self.p_shapes, self.q_shapes, self.ranks))
        object.__setattr__(self, "p_shapes", p)
        object.__setattr__(self, "q_shapes", q)
        object.__setattr__(self, "ranks", r)
        if not 2 <= len(p) <= 4:
            raise ValueError(f"TT tables have 2 to 4 cores, got p_shapes {p}")
        if len(q) != len(p) or len(r) != len(p) - 1:
            raise ValueError(f"need len(q_shapes) == len(p_shapes) == len(ranks) + 1, got "
                             f"p={p} q={q} ranks={r}")
        if min(p + q + r) <= 0:
            raise ValueError(f"shapes and ranks must be positive: p={p} q={q} ranks={r}")

    @property
    def d(self) -> int:
        return len(self.p_shapes)

    @property
    def padded_ranks(self) -> tuple:
        return (1,) + self.ranks + (1,)

    @property
    def num_rows(self) -> int:
        return math.prod(self.p_shapes)

    @property
    def dim(self) -> int:
        return math.prod(self.q_shapes)

    def core_shape(self, k: int) -> tuple:
        r = self.padded_ranks
        return (self.p_shapes[k], r[k] * self.q_shapes[k] * r[k + 1])

    def core_slices(self, core, k: int):
        """Core ``k`` as ``(p_k, R_k, q_k, R_{k+1})``."""
        r = self.padded_ranks
        core = core if is_cupy_array(core) else np.asarray(core)
        return core.reshape(self.p_shapes[k], r[k], self.q_shapes[k], r[k + 1])

    def digits(self, idx):
        """``(n, d)`` digits of row indices, most significant first (same namespace)."""
        xp = array_module(idx) if is_cupy_array(idx) else np
        idx = xp.asarray(idx, dtype=xp.int64)
        strides = [math.prod(self.p_shapes[k + 1:]) for k in range(self.d)]
        return xp.stack([(idx // s) % p for s, p in zip(strides, self.p_shapes)], axis=1)

    def check_cores(self, cores) -> None:
        if len(cores) != self.d:
            raise ValueError(f"{self.d} cores expected, got {len(cores)}")
        for k, core in enumerate(cores):
            if tuple(np.shape(core)) != self.core_shape(k):
                raise ValueError(f"core {k} must have shape {self.core_shape(k)}, got "
                                 f"{tuple(np.shape(core))}")


# ----------------------------------------------------------------------------- shapes


def _balanced_factors(n: int, d: int) -> list[int]:
    """``d`` factors of ``n`` (product exactly ``n``), as equal as greedy placement of its
    prime factors, largest first, into the currently smallest factor makes them."""
    primes, m, f = [], n, 2
    while f * f <= m:
        while m % f == 0:
            primes.append(f)
            m //= f
        f += 1
    if m > 1:
        primes.append(m)
    factors = [1] * d
    for prime in sorted(primes, reverse=True):
        factors[factors.index(min(factors))] *= prime
    return sorted(factors)


def _spread(factors) -> float:
    """How unbalanced a factorization is (0 for equal factors)."""
    logs = np.log(np.asarray(factors, dtype=np.float64))
    return float(logs.max() - logs.min())


def suggest_tt_shapes(n: int, d: int = 3, allow_round_up: bool = True) -> list[int]:
    """A balanced factorization of ``n`` into ``d`` factors.

    With ``allow_round_up`` (for row counts), ``n`` may be rounded up to ``ceil(n / 10^k) *
    10^k`` when that balances the factors better, so their product is >= ``n``. Embedding
    dimensions use ``allow_round_up=False``: the product is exactly ``n`` (128 -> [4, 4, 8]).
    """
    if n <= 0 or not 2 <= d <= 4:
        raise ValueError(f"need n > 0 and 2 <= d <= 4, got n={n}, d={d}")
    best = _balanced_factors(n, d)
    if allow_round_up:
        for k in range(1, len(str(n))):
            candidate = _balanced_factors(-(-n // 10 ** k) * 10 ** k, d)
            if _spread(candidate) < _spread(best) - 1e-12:
                best = candidate
    return best


# ----------------------------------------------------------------------------- init


def init_tt_cores(shape: TTShape, weight_dist: str = "approx-normal", num_embeddings=None,
                  rng=None) -> list[np.ndarray]:
    """Float32 cores drawn as FBTT-Embedding draws them.

    ``uniform``: i.i.d. U(0, s) with ``s = (2 / (N + D)) ** (1 / (2 d)) * prod(R ** (-1 / (2 d)))``.
    ``normal``: i.i.d. N(0, 1 / sqrt(N)). ``approx-normal``: N(0, 1) draws kept only where
    ``|x| >= 2`` (redrawn otherwise), times ``(1 / sqrt(3 N)) ** (1 / 3)``. ``approx-uniform``
    (3 cores): FBTT's saw-tooth construction, so that rows of the full table look uniform.
    ``N`` is ``num_embeddings`` (default: the table's rows). Vectorized: seconds, not minutes,
    for large cores.
    """
    rng = np.random.default_rng() if rng is None else rng
    n_rows = shape.num_rows if num_embeddings is None else int(num_embeddings)
    d, ranks = shape.d, np.asarray(shape.padded_ranks, dtype=np.float64)
    if weight_dist == "uniform":
        stddev = math.sqrt(2.0 / (n_rows + shape.dim))
        core_stddev = stddev ** (1.0 / d) * np.prod(ranks ** (-1.0 / (2 * d)))
        return [rng.uniform(0.0, core_stddev, shape.core_shape(k)).astype(np.float32)
                for k in range(d)]
    if weight_dist == "normal":
        return [rng.normal(0.0, 1.0 / math.sqrt(n_rows), shape.core_shape(k)).astype(np.float32)
                for k in range(d)]
    if weight_dist == "approx-normal":
        scale = (1.0 / math.sqrt(3 * n_rows)) ** (1.0 / 3.0)
        cores = []
        for k in range(d):
            w = rng.standard_normal(shape.core_shape(k))
            small = np.abs(w) < 2
            while small.any():  # redraw only the rejected entries
                w[small] = rng.standard_normal(int(small.sum()))
                small = np.abs(w) < 2
            cores.append((w * scale).astype(np.float32))
        return cores
    if weight_dist == "approx-uniform":
        return _approx_uniform(shape, n_rows, rng)
    raise ValueError(f"weight_dist must be 'uniform', 'normal', 'approx-uniform' or "
                     f"'approx-normal', got {weight_dist!r}")


def _saw_tooth(rng, count, grid=15, width=0.7 / 30.0):
    # A train of flat teeth j / grid + U(-width / 2, width / 2): convolved with a narrow
    # Gaussian (the other cores' noise) the gaps fill and the result looks uniform.
    j = rng.integers(-(grid - 1), grid, count)
    return j / grid - width / 2.0 + width * rng.random(count)


def _approx_uniform(shape: TTShape, n_rows: int, rng) -> list[np.ndarray]:
    if shape.d != 3:
        raise ValueError("approx-uniform initialization is defined for 3 cores")
    (p1, p2, p3), (q1, q2, q3) = shape.p_shapes, shape.q_shapes
    _, r1, r2, _ = shape.padded_ranks
    sigma = 0.01
    head = 1.0 / math.sqrt(r1) + sigma * rng.standard_normal((1, p1, q1, r1))
    mid_scale = 1.0 / math.sqrt(r1)
    mid = (mid_scale + sigma * rng.standard_normal((r1, p2, q2, r2))).reshape(r1, p2 * q2, r2)
    values = _saw_tooth(rng, p2 * q2) / mid_scale
    columns = np.arange(p2 * q2)
    picks = rng.integers(0, (r2 + 1) // 2, p2 * q2) * 2  # an even rank index per (m, n)
    mid[:, columns, picks] = (rng.standard_normal((r1, p2 * q2)) * (sigma * sigma / mid_scale))
    mid[rng.integers(0, r1, p2 * q2), columns, picks] = values
    tail = sigma * rng.standard_normal((r2, p3 * q3))
    odd = max(1, r2 // 2)
    rows = np.minimum(rng.integers(0, odd, p3 * q3) * 2 + 1, r2 - 1)  # an odd rank index
    tail[rows, np.arange(p3 * q3)] = _saw_tooth(rng, p3 * q3)
    scale = 1.0 / (math.sqrt(n_rows) ** (1.0 / 3.0))
    blocks = [head, mid.reshape(r1, p2, q2, r2), tail.reshape(r2, p3, q3, 1)]
    return [(b * scale).transpose(1, 0, 2, 3).reshape(shape.core_shape(k)).astype(np.float32)
            for k, b in enumerate(blocks)]


# ----------------------------------------------------------------------------- lookups


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


def _prefix_products(cores, shape: TTShape, digits, upto: int, dtype):
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


def _suffix_products(cores, shape: TTShape, digits, start: int, dtype):
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


def _scatter_add(out, idx, values) -> None:
    """``out[idx] += values`` with repeated indices summed, on either namespace."""
    if is_cupy_array(out):
        import cupyx

        cupyx.scatter_add(out, idx, values)
    else:
        np.add.at(out, idx, values)


def tt_rows(cores, shape: TTShape, idx) -> np.ndarray:
    """Rows ``idx`` of the table (float32), batched slice products."""
    shape.check_cores(cores)
    digits = shape.digits(_checked_indices(idx, shape))
    return _prefix_products(cores, shape, digits, shape.d, np.float32)[:, :, 0]


def tt_to_dense(cores, shape: TTShape) -> np.ndarray:
    """The whole table, ``(prod(p), prod(q))`` float32 (FBTT's ``tt_matrix_to_full``)."""
    return tt_rows(cores, shape, np.arange(shape.num_rows))


def tt_from_dense(table, ranks, p_shapes, q_shapes) -> list[np.ndarray]:
    """Compress a trained ``(rows, dim)`` table into TT cores of at most ``ranks`` (TT-SVD).

    Rows beyond ``len(table)`` up to ``prod(p_shapes)`` are zero. With full ranks the
    reconstruction is exact; smaller ranks give the truncated-SVD approximation.
    """
    shape = TTShape(p_shapes, q_shapes, ranks)
    table = np.asarray(table, dtype=np.float64)
    if table.ndim != 2 or table.shape[1] != shape.dim or table.shape[0] > shape.num_rows:
        raise ValueError(f"table must be (<= {shape.num_rows}, {shape.dim}), got {table.shape}")
    full = np.zeros((shape.num_rows, shape.dim))
    full[:len(table)] = table
    d, p, q = shape.d, shape.p_shapes, shape.q_shapes
    # Interleave to (p1, q1, p2, q2, ...): the TT of this tensor has cores (R, p_k, q_k, R).
    tensor = full.reshape(*p, *q).transpose([x for k in range(d) for x in (k, d + k)])
    cores, rank, rest = [], 1, tensor.reshape(-1)
    for k in range(d - 1):
        rest = rest.reshape(rank * p[k] * q[k], -1)
        u, s, vt = np.linalg.svd(rest, full_matrices=False)
        keep = min(shape.ranks[k], len(s))
        core = u[:, :keep].reshape(rank, p[k], q[k], keep)
        if keep < shape.ranks[k]:  # pad to the requested rank with zeros
            core = np.concatenate([core, np.zeros((rank, p[k], q[k], shape.ranks[k] - keep))],
                                  axis=3)
            s = np.concatenate([s[:keep], np.zeros(shape.ranks[k] - keep)])
            vt = np.concatenate([vt[:keep], np.zeros((shape.ranks[k] - keep, vt.shape[1]))])
        else:
            s, vt = s[:keep], vt[:keep]
        cores.append(core)
        rest = s[:, None] * vt
        rank = shape.ranks[k]
    cores.append(rest.reshape(rank, p[-1], q[-1], 1))
    return [c.transpose(1, 0, 2, 3).reshape(shape.core_shape(k)).astype(np.float32)
            for k, c in enumerate(cores)]


# ----------------------------------------------------------------------------- bags


def _check_index_array(idx) -> None:
    if idx.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, got {idx.dtype}")
    if idx.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {idx.shape}")


def _checked_indices(idx, shape: TTShape, num_embeddings=None):
    bound = shape.num_rows if num_embeddings is None else int(num_embeddings)
    xp = array_module(idx) if is_cupy_array(idx) else np
    idx = xp.asarray(idx)
    _check_index_array(idx)
    bad = xp.flatnonzero((idx < 0) | (idx >= bound))
    if bad.size:
        position = int(bad[0])
        raise IndexError(f"index {int(idx[position])} at position {position} is out of range "
                         f"for a TT table of {bound} rows (valid: 0 <= index < {bound})")
    return idx.astype(xp.int64)


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


def _lookup_weights(counts, bag, per_sample_weights, mode, n, dtype):
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
    indices = _checked_indices(indices, shape)
    bag, counts = _bag_ids(indices, offsets, include_last_offset)
    w = _lookup_weights(counts, bag, per_sample_weights, mode, len(indices), np.float64)
    rows = tt_rows_reference(cores, shape, indices) * w[:, None]
    out = np.zeros((len(counts), shape.dim))
    np.add.at(out, bag, rows)
    return out


def tt_bag_residuals(shape: TTShape, indices, offsets, *, mode="sum", per_sample_weights=None,
                     include_last_offset=True, num_embeddings=None):
    """What backward needs, checked: ``(indices, bag of each lookup, weight of each lookup,
    number of bags)``; for GPU indices of a shape the kernels take, a :class:`TTBagPlan`."""
    if _uses_kernels(shape, indices):
        return _gpu_plan(None, shape, indices, offsets, mode, per_sample_weights,
                         include_last_offset, True, num_embeddings)[1]
    indices = _checked_indices(indices, shape, num_embeddings)
    bag, counts = _bag_ids(indices, offsets, include_last_offset)
    w = _lookup_weights(counts, bag, per_sample_weights, mode, len(indices), np.float32)
    return indices, bag, w, len(counts)


def tt_embedding_bag_fwd(cores, shape: TTShape, indices, offsets, *, mode="sum",
                         per_sample_weights=None, include_last_offset=True, check=True,
                         num_embeddings=None, out=None, cache=None, cache_count=False,
                         report=None):
    """``(bags, residuals)``: pooled rows ``(B, D)`` (float32) and what backward needs.

    GPU (CuPy) arrays run the CUDA kernels (see :class:`TTBagPlan`); ``check=False`` there
    leaves the verdict on bad indices or offsets unread until backward or
    :func:`tt_check_plan` (no host sync in the forward; the bags of a rejected batch are
    zeros and nothing is ever written outside them). NumPy arrays are checked at once.
    ``num_embeddings``: indices must be below it (default: every row of the factorization).
    ``out``: a ``(B, D)`` float32 array (of the cores' namespace) to write the bags into.
    ``cache``: a :class:`TTRowCache`; while it is active, lookups of its rows read its dense
    rows instead; ``cache_count`` also counts the lookups in its frequency table (on the GPU
    in the same launch as the cache lookups). ``report``: GPU indices to name in an index
    error instead of ``indices`` (same length; for callers that map their indices).
    """
    shape.check_cores(cores)
    if _uses_kernels(shape, indices, cores):
        return _gpu_plan(cores, shape, indices, offsets, mode, per_sample_weights,
                         include_last_offset, check, num_embeddings, out, cache, cache_count,
                         report)
    indices, bag, w, num_bags = tt_bag_residuals(
        shape, indices, offsets, mode=mode, per_sample_weights=per_sample_weights,
        include_last_offset=include_last_offset, num_embeddings=num_embeddings)
    rows = tt_rows(cores, shape, indices)
    if cache is not None and cache_count:
        cache.count(indices)
    if cache is not None and cache.active:
        slot = cache.slots(indices)
        xp = array_module(rows)
        rows = xp.where((slot >= 0)[:, None], cache.weight[xp.maximum(slot, 0)], rows)
    rows = rows * w[:, None]
    bags = array_module(rows).zeros((num_bags, shape.dim), dtype=np.float32)
    _scatter_add(bags, bag, rows)
    if out is None:
        return bags, (indices, bag, w)
    _check_out(out, num_bags, shape)
    out[...] = bags
    return out, (indices, bag, w)


def _check_out(out, num_bags: int, shape: TTShape) -> None:
    if tuple(out.shape) != (num_bags, shape.dim) or out.dtype != np.float32:
        raise ValueError(f"out must be float32 of shape {(num_bags, shape.dim)}, got "
                         f"{out.dtype} {tuple(out.shape)}")


def tt_embedding_bag(cores, shape, indices, offsets, **kwargs) -> np.ndarray:
    """Pooled TT rows per bag (sum or mean, optional per-sample weights), float32."""
    return tt_embedding_bag_fwd(cores, shape, indices, offsets, **kwargs)[0]


def tt_embedding_bag_bwd(cores, shape: TTShape, residuals, grad_bags) -> list[np.ndarray]:
    """Gradients of the cores (float32, the cores' shapes) from ``(B, D)`` bag gradients.

    For lookup ``n`` with digits ``i``, the slice gradient of core ``k`` is
    ``sum_{a,b} Left[n, a, r] * g[n, a, j, b] * Right[n, s, b]``, with ``Left`` the product of
    the slices before ``k`` and ``Right`` of those after; rows of repeated digits add up.
    """
    if isinstance(residuals, TTBagPlan):
        grad, _ = _gpu_core_grads(cores, shape, residuals, grad_bags, dense=True)
        tt_check_plan(residuals, shape)
        return [grad[start:stop].reshape(shape.core_shape(k))
                for k, (start, stop) in enumerate(_grad_spans(shape))]
    indices, bag, w = residuals
    xp = array_module(indices)
    digits = shape.digits(indices)
    n = len(indices)
    g = xp.asarray(grad_bags, dtype=np.float32)[bag] * w[:, None]  # (n, D)
    grads = []
    q = shape.q_shapes
    for k in range(shape.d):
        left = _prefix_products(cores, shape, digits, k, np.float32)  # (n, A, R_k)
        right = _suffix_products(cores, shape, digits, k + 1, np.float32)  # (n, R_k+1, B)
        a, r_k, r_k1, b = left.shape[1], left.shape[2], right.shape[1], right.shape[2]
        # sum_a Left[n,a,r] g[n,a,(j,b)] -> (n, r, j, b); then sum_b (.)[n,r,j,b] Right[n,s,b]
        t = xp.matmul(left.transpose(0, 2, 1), g.reshape(n, a, q[k] * b))
        slice_grads = xp.matmul(t.reshape(n, r_k * q[k], b), right.transpose(0, 2, 1))
        slice_grads = slice_grads.reshape(n, r_k, q[k], r_k1)
        grad = xp.zeros((shape.p_shapes[k],) + slice_grads.shape[1:], dtype=np.float32)
        _scatter_add(grad, digits[:, k], slice_grads)
        grads.append(grad.reshape(shape.core_shape(k)))
    return grads


# ----------------------------------------------------------------------------- fused updates

# FBGEMM's rules (not torch.optim's: no momentum, weight decay or maximize where FBGEMM has
# none); the kernels dispatch on their xferlib.optim.rules.OptId ids.
SPARSE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "rowwise_adam", "lamb", "lars_sgd",
                     "partial_rowwise_adam", "partial_rowwise_lamb")
# Optimizers that update only the rows a batch touched (a zero gradient still moves their
# state or weights): the others update whole cores at once.
_LAZY = ("rowwise_adam", "lamb", "lars_sgd", "partial_rowwise_adam", "partial_rowwise_lamb")


def tt_sparse_state(shape: TTShape, optimizer: str, xp=np) -> list[dict]:
    """Zeroed optimizer state per core for :func:`tt_sparse_update` (``xp``: numpy or cupy,
    where the cores live)."""
    return [_row_state(*shape.core_shape(k), optimizer, xp) for k in range(shape.d)]


# Each optimizer's state per parameter row, primary entry first (FBTT's ``optimizer_state``):
# "elem" a float32 value per element, "row" one float32 per row, "step" an int64 count per row.
# The kernels' update_row takes them as [elem, second elem, row, step] pointers.
_STATE = {
    "sgd": (),
    "adagrad": (("sum", "elem"),),
    "rowwise_adagrad": (("sum", "row"),),
    "rowwise_adam": (("exp_avg", "elem"), ("exp_avg_sq", "row"), ("step", "step")),
    "lamb": (("exp_avg", "elem"), ("exp_avg_sq", "elem")),
    "lars_sgd": (("momentum", "elem"),),
    "partial_rowwise_adam": (("exp_avg", "elem"), ("exp_avg_sq", "row")),
    "partial_rowwise_lamb": (("exp_avg", "elem"), ("exp_avg_sq", "row")),
}


def _row_state(rows: int, width: int, optimizer: str, xp=np) -> dict:
    """Zeroed state of ``optimizer`` for ``rows`` parameter rows of ``width``; the first entry
    is the primary one (FBTT's ``optimizer_state``)."""
    if optimizer not in SPARSE_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {SPARSE_OPTIMIZERS}, got {optimizer!r}")
    shapes = {"elem": ((rows, width), np.float32), "row": (rows, np.float32),
              "step": (rows, np.int64)}
    return {name: xp.zeros(*shapes[where]) for name, where in _STATE[optimizer]}


def tt_sparse_update(cores, shape: TTShape, residuals, grads, states, optimizer: str, *,
                     lr: float, eps: float = 1e-10, betas=(0.9, 0.999), **hyper) -> None:
    """Apply ``optimizer`` in place to every core row the batch touched (all of them: no row
    of any core is skipped), from the core gradients of :func:`tt_embedding_bag_bwd`.

    ``sgd``: ``G -= lr g``. ``adagrad``: elementwise ``s += g^2; G -= lr g / (sqrt(s) + eps)``.
    ``rowwise_adagrad``: one accumulator per core row, ``s += mean(g^2)``. ``rowwise_adam``:
    elementwise first moment, one second moment and step count per row, bias-corrected.
    ``lamb``, ``lars_sgd``, ``partial_rowwise_adam``, ``partial_rowwise_lamb``: FBGEMM's rules
    of these names, per row (see :func:`_update_rows`), with ``hyper``: ``weight_decay``
    (0), ``eta`` (0.001, LARS), ``momentum`` (0.9, LARS) and ``step`` (the global iteration,
    from 1, for the bias corrections).
    Rows the batch did not touch keep their values and state (lazy semantics).
    """
    _check_sparse_args(optimizer, lr)
    digits = shape.digits(residuals.indices if isinstance(residuals, TTBagPlan) else
                          residuals[0])
    xp = array_module(digits)
    # A core row the batch did not touch has a zero gradient, which leaves it and its sgd /
    # adagrad / row-wise adagrad state exactly as they are (eps > 0 keeps 0 / sqrt(0) away):
    # those update the whole (small) core at once, with no sort and no host sync.
    whole = optimizer == "sgd" or (optimizer in ("adagrad", "rowwise_adagrad") and eps > 0)
    for k, (core, grad, state) in enumerate(zip(cores, grads, states)):
        rows = slice(None) if whole else xp.unique(digits[:, k])
        _update_rows(core, grad, state, rows, optimizer, lr, eps, betas, **hyper)


def _check_sparse_args(optimizer: str, lr: float) -> None:
    if optimizer not in SPARSE_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {SPARSE_OPTIMIZERS}, got {optimizer!r}")
    if lr < 0:
        raise ValueError(f"Invalid learning rate: {lr}")


def _update_rows(param, grad, state, rows, optimizer: str, lr: float, eps: float, betas, *,
                 weight_decay: float = 0.0, eta: float = 0.001, momentum: float = 0.9,
                 step: int = 1) -> None:
    """``optimizer`` on rows ``rows`` of a 2-D ``param`` (a core, or a cache of dense rows) from
    their gradient rows, in place, with ``state`` shaped as :func:`tt_sparse_state` makes it.

    FBGEMM's rules, per row ``w`` with gradient ``g`` (``t = step``, the global iteration):
    ``lamb``: ``m, v`` elementwise Adam moments, ``r = m / (1 - b1^t) / (sqrt(v / (1 - b2^t))
    + eps) + weight_decay w``, ``w -= lr |w| / |r| r``. ``partial_rowwise_lamb``: the same with
    one ``v`` per row from ``mean(g^2)``. ``partial_rowwise_adam``: ``w -= lr (m / (1 - b1^t) /
    (sqrt(v / (1 - b2^t)) + eps) + weight_decay w)``, ``v`` per row. ``lars_sgd``: ``lr' = lr eta
    |w| / (|g| + weight_decay |w|)``, ``m = momentum m + lr' (g + weight_decay w)``, ``w -= m``.
    Where FBGEMM would divide 0 by 0 (a zero update or zero norms) the row is left unchanged.
    """
    xp = array_module(param)
    b1, b2 = betas
    f32 = np.float32
    g = grad[rows]
    if optimizer == "sgd":
        param[rows] -= f32(lr) * g
    elif optimizer == "adagrad":
        s = state["sum"]
        s[rows] += g * g
        param[rows] -= f32(lr) * g / (xp.sqrt(s[rows]) + f32(eps))
    elif optimizer == "rowwise_adagrad":
        s = state["sum"]
        s[rows] += (g * g).mean(axis=1)
        param[rows] -= f32(lr) * g / (xp.sqrt(s[rows])[:, None] + f32(eps))
    elif optimizer == "rowwise_adam":
        m, v, steps = state["exp_avg"], state["exp_avg_sq"], state["step"]
        steps[rows] += 1
        m[rows] = f32(b1) * m[rows] + f32(1 - b1) * g
        v[rows] = f32(b2) * v[rows] + f32(1 - b2) * (g * g).mean(axis=1)
        t = steps[rows].astype(np.float64)
        m_hat = m[rows] / (1 - b1 ** t)[:, None].astype(f32)
        v_hat = (v[rows] / (1 - b2 ** t)).astype(f32)
        param[rows] -= f32(lr) * m_hat / (xp.sqrt(v_hat)[:, None] + f32(eps))
    elif optimizer == "lars_sgd":
        w = param[rows]
        w_norm = xp.sqrt((w * w).sum(axis=1))
        denom = xp.sqrt((g * g).sum(axis=1)) + f32(weight_decay) * w_norm
        scale = xp.where(denom > 0, f32(lr * eta) * w_norm / xp.where(denom > 0, denom, 1), 0)
        mom = state["momentum"]
        mom[rows] = f32(momentum) * mom[rows] + scale[:, None].astype(f32) * (
            g + f32(weight_decay) * w)
        param[rows] = w - mom[rows]
    else:  # the Adam family with a global step
        w = param[rows]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        c1, c2 = f32(1 - b1 ** step), f32(1 - b2 ** step)
        m[rows] = f32(b1) * m[rows] + f32(1 - b1) * g
        if optimizer == "lamb":
            v[rows] = f32(b2) * v[rows] + f32(1 - b2) * g * g
            denom = xp.sqrt(v[rows] / c2) + f32(eps)
        else:
            v[rows] = f32(b2) * v[rows] + f32(1 - b2) * (g * g).mean(axis=1)
            denom = (xp.sqrt(v[rows] / c2) + f32(eps))[:, None]
        update = m[rows] / c1 / denom + f32(weight_decay) * w
        if optimizer == "partial_rowwise_adam":
            param[rows] = w - f32(lr) * update
            return
        w_norm = xp.sqrt((w * w).sum(axis=1))
        u_norm = xp.sqrt((update * update).sum(axis=1))
        ratio = xp.where(u_norm > 0, w_norm / xp.where(u_norm > 0, u_norm, 1), 0).astype(f32)
        param[rows] = w - f32(lr) * ratio[:, None] * update


def tt_fused_update(cores, shape: TTShape, residuals, grad_bags, states, optimizer: str, *,
                    lr: float, eps: float = 1e-10, betas=(0.9, 0.999), cache=None,
                    defer_check: bool = False, **hyper):
    """Backward and :func:`tt_sparse_update` in one: the cores change in place from the bag
    gradients. On the GPU kernel path no dense core gradient exists: each touched core row's
    gradient is summed (in sorted order, deterministic) and the optimizer runs on those rows
    only. A forward's deferred input check is read once the update is queued: the kernels of a
    rejected batch change nothing, and the error is raised before this function returns.
    With an active ``cache`` its hit rows take the same optimizer step on their dense values
    (on the kernel path in one more kernel, no host sync), and the cores still learn from
    every lookup (write-through, see :class:`TTRowCache`). ``hyper``: see
    :func:`tt_sparse_update`.

    ``defer_check`` (kernel path): do not wait for the input check at all; return a
    :class:`TTPendingCheck` whose ``resolve()`` raises for a rejected batch later (the batch
    changed nothing). The step then takes no host synchronization. ``"silent"``: no check and
    no copy at all (a step captured in a CUDA graph; the caller reads the plan's verdict with
    :func:`tt_check_plan` after replays). Otherwise returns None.
    """
    _check_sparse_args(optimizer, lr)
    kernel_path = isinstance(residuals, TTBagPlan)
    step = hyper.get("step", 1)
    if not kernel_path and not isinstance(step, (int, np.integer)):  # a device counter
        hyper["step"] = int(_to_host(step).reshape(-1)[0])
    if cache is not None and cache.active and not kernel_path:
        grad, touched = tt_cache_grad(cache, shape, residuals, grad_bags)
        rows = (array_module(touched).flatnonzero(touched) if optimizer in _LAZY
                else slice(None))
        _update_rows(cache.weight, grad, cache.state, rows, optimizer, lr, eps, betas, **hyper)
    if not kernel_path:
        grads = tt_embedding_bag_bwd(cores, shape, residuals, grad_bags)
        tt_sparse_update(cores, shape, residuals, grads, states, optimizer, lr=lr, eps=eps,
                         betas=betas, **hyper)
        return
    grad, touched = _gpu_core_grads(cores, shape, residuals, grad_bags, dense=False)
    if grad is None:  # an empty batch touches nothing
        return
    args = _optimizer_args(optimizer, lr, eps, betas, **hyper)
    if cache is not None and cache.active and residuals.slot is not None:
        _launch_cache_update(cache, shape, residuals, grad_bags, optimizer, args)
    pad = [np.uint64(0)] * (4 - shape.d)
    pointers = [_state_pointers(st, optimizer) for st in states]
    _launch(shape, "tt_update", (_total_core_rows(shape),), (256,),
            list(cores) + pad + [x for j in range(4) for x in
                                 ([p[j] for p in pointers] + pad)]
            + [grad, touched] + args)
    # Read the input check only now: a rejected batch's kernels wrote nothing (no row was
    # flagged as touched), and the host waited for nothing while the step was being queued.
    if defer_check == "silent":  # the caller reads residuals.verdict itself (CUDA graphs)
        return None
    if defer_check and not residuals.checked:
        return TTPendingCheck(residuals, shape)
    tt_check_plan(residuals, shape)
    return None


# The fused update in two halves, for callers that combine the gradients of several
# processes (data parallelism) between them: the sum of every process's gradient applied
# once equals one fused update on the concatenated batch.


def tt_core_grads(cores, shape: TTShape, residuals, grad_bags):
    """``(grad, touched)``: the first half of :func:`tt_fused_update`.

    ``grad``: every core's gradient in one flat float32 array (core ``k`` at offset
    ``sum(p_j * width_j for j < k)``, row-major), zeros in rows the batch did not touch;
    ``touched``: int32, one flag per core row (core ``k``'s rows from ``sum(p[:k])``), 1 where
    the batch touched it. Both are core-sized: no dense table gradient. Adding several batches'
    ``grad`` and taking the union (or sum) of their ``touched`` and handing them to
    :func:`tt_apply_core_grads` equals one :func:`tt_fused_update` on the concatenated batches
    (up to float summation order). On the kernel path a rejected batch (see
    :func:`tt_check_plan`) gives zeros and touches nothing; its verdict is not read here.

    >>> shape = TTShape([4, 5], [2, 2], [3])
    >>> cores = init_tt_cores(shape, "normal", rng=np.random.default_rng(0))
    >>> _, res = tt_embedding_bag_fwd(cores, shape, np.array([1, 7, 7]), np.array([0, 1, 3]))
    >>> grad, touched = tt_core_grads(cores, shape, res, np.ones((2, 4), np.float32))
    >>> grad.shape, touched.tolist()
    ((54,), [1, 1, 0, 0, 0, 1, 1, 0, 0])
    """
    total = _total_core_rows(shape)
    if isinstance(residuals, TTBagPlan):
        grad, touched = _gpu_core_grads(cores, shape, residuals, grad_bags, dense=True)
        if touched is None:  # an empty batch
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


def tt_apply_core_grads(cores, shape: TTShape, grad, touched, states, optimizer: str, *,
                        lr: float, eps: float = 1e-10, betas=(0.9, 0.999), **hyper) -> None:
    """The second half of :func:`tt_fused_update`: apply ``optimizer`` in place to the core
    rows flagged in ``touched`` (nonzero) from the flat ``grad`` (laid out as
    :func:`tt_core_grads` makes them), with the same rules, state and ``hyper`` as
    :func:`tt_sparse_update`. Unflagged rows keep their values and state. CuPy cores of a
    shape the kernels take run the fused kernel (no host sync; ``step`` may be a device
    counter); otherwise the array path.
    """
    _check_sparse_args(optimizer, lr)
    total, size = _total_core_rows(shape), _grad_spans(shape)[-1][1]
    if tuple(grad.shape) != (size,) or tuple(touched.shape) != (total,):
        raise ValueError(f"grad must have shape ({size},) and touched ({total},), got "
                         f"{tuple(grad.shape)} and {tuple(touched.shape)}")
    shape.check_cores(cores)
    if _uses_kernels(shape, touched, cores):
        import cupy

        grad = cupy.ascontiguousarray(grad, dtype=np.float32)
        touched = cupy.ascontiguousarray(touched, dtype=np.int32)
        args = _optimizer_args(optimizer, lr, eps, betas, **hyper)
        pad = [np.uint64(0)] * (4 - shape.d)
        pointers = [_state_pointers(st, optimizer) for st in states]
        _launch(shape, "tt_update", (total,), (256,),
                list(cores) + pad + [x for j in range(4) for x in
                                     ([p[j] for p in pointers] + pad)]
                + [grad, touched] + args)
        return
    hyper = _host_step(hyper)
    xp = array_module(grad)
    # as tt_sparse_update: rules a zero gradient leaves unchanged update whole cores
    whole = optimizer == "sgd" or (optimizer in ("adagrad", "rowwise_adagrad") and eps > 0)
    start = 0
    for k, ((lo, hi), core, state) in enumerate(zip(_grad_spans(shape), cores, states)):
        p = shape.p_shapes[k]
        rows = slice(None) if whole else xp.flatnonzero(touched[start:start + p])
        _update_rows(core, grad[lo:hi].reshape(shape.core_shape(k)), state, rows, optimizer,
                     lr, eps, betas, **hyper)
        start += p


def tt_cache_apply(cache: "TTRowCache", grad, touched, optimizer: str, *, lr: float,
                   eps: float = 1e-10, betas=(0.9, 0.999), **hyper) -> None:
    """The row cache's optimizer step from :func:`tt_cache_grad`'s ``(grad, touched)`` (or
    their sums over several batches): what :func:`tt_fused_update` applies to an active cache,
    on the array path (a host sync for the touched rows on the GPU)."""
    _check_sparse_args(optimizer, lr)
    if tuple(grad.shape) != tuple(cache.weight.shape) or tuple(touched.shape) != (
            cache.capacity,):
        raise ValueError(f"grad must have shape {tuple(cache.weight.shape)} and touched "
                         f"({cache.capacity},), got {tuple(grad.shape)} and "
                         f"{tuple(touched.shape)}")
    xp = array_module(grad)
    whole = optimizer == "sgd" or (optimizer in ("adagrad", "rowwise_adagrad") and eps > 0)
    rows = slice(None) if whole else xp.flatnonzero(touched)
    _update_rows(cache.weight, grad, cache.state, rows, optimizer, lr, eps, betas,
                 **_host_step(hyper))


def _host_step(hyper: dict) -> dict:
    """``hyper`` with a device step counter read on the host (the array path needs it)."""
    step = hyper.get("step", 1)
    if isinstance(step, (int, np.integer)):
        return hyper
    return {**hyper, "step": int(_to_host(step).reshape(-1)[0])}


def _state_pointers(state: dict, optimizer: str) -> list:
    """``[elementwise, second elementwise, per row, per-row steps]`` state of one parameter
    (NULL where the optimizer has none), as the kernels' ``update_row`` takes them."""
    pointers = [np.uint64(0)] * 4
    elem = 0
    for name, where in _STATE[optimizer]:
        if where == "elem":
            position, elem = elem, elem + 1
        else:
            position = 2 if where == "row" else 3
        # a step count may be absent (the kernel then reads none); other state may not
        pointers[position] = state.get(name, pointers[position]) if where == "step" else \
            state[name]
    return pointers


def _optimizer_args(optimizer, lr, eps, betas, *, weight_decay=0.0, eta=0.001, momentum=0.9,
                    step=1) -> list:
    """The kernels' optimizer arguments (after the state pointers); ``step``: an int or a
    one-element int64 device array (read by the kernels when they run)."""
    import cupy

    if isinstance(step, (int, np.integer)):
        step = cupy.full(1, int(step), dtype=np.int64)
    return [np.int32(OptId[optimizer.upper()]), np.float32(lr), np.float32(eps),
            np.float64(betas[0]), np.float64(betas[1]), np.float32(weight_decay),
            np.float32(eta), np.float32(momentum), step]


def _launch_cache_update(cache, shape: TTShape, plan: TTBagPlan, grad_bags, optimizer, args):
    """The cached rows' optimizer step on the GPU, one launch: each run of one row in the sorted
    batch that hits the cache has its gradients summed (in a fixed order) and its row updated
    by one block (see ``tt_cache_update`` in xferlib/_kernels/tt.py)."""
    import cupy

    from xferlib._kernels.tt import CACHE_THREADS

    grad_bags = cupy.ascontiguousarray(cupy.asarray(grad_bags, dtype=np.float32))
    weights = plan.per_sample_weights
    n = plan.n
    _launch(shape, f"tt_cache_update<{_key_name(plan.rows)}>",
            (max(1, min(-(-n // CACHE_THREADS), 2048)),), (CACHE_THREADS,),
            [plan.rows, plan.perm, np.int64(n), plan.bag_of, plan.offsets,
             np.int64(plan.offsets.size), np.int32(plan.include_last_offset),
             weights if weights is not None else np.uint64(0), np.int32(plan.mean),
             grad_bags, plan.slot, np.int64(cache.capacity), cache.weight]
            + _state_pointers(cache.state, optimizer) + args + [plan.verdict])


# ----------------------------------------------------------------------------- row cache

NO_ROW = np.iinfo(np.int64).max  # an empty cache slot: sorts after every row
_HASH = 0x9E3779B97F4A7C15  # Fibonacci hashing of row ids into the frequency table
_PROBES = 32  # open addressing: a row is counted within 32 slots of its hash, or not at all


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
        self.state = _row_state(self.capacity, shape.dim, optimizer, xp)
        self.freq_keys = xp.full(int(hashtbl_size), -1, dtype=np.int64)
        self.freq_counts = xp.zeros(int(hashtbl_size), dtype=np.int64)
        self.key_slots = xp.full(int(hashtbl_size), -1, dtype=np.int32)
        self.active = False

    @classmethod
    def from_arrays(cls, shape: TTShape, optimizer: str, *, rows, weight, state, freq_keys,
                    freq_counts, key_slots, active: bool) -> "TTRowCache":
        """A cache over existing arrays (a framework's tensors seen as NumPy/CuPy arrays)."""
        cache = cls.__new__(cls)
        cache.shape, cache.optimizer, cache.capacity = shape, optimizer, int(rows.shape[0])
        cache.rows, cache.weight, cache.state = rows, weight, dict(state)
        cache.freq_keys, cache.freq_counts = freq_keys, freq_counts
        cache.key_slots, cache.active = key_slots, bool(active)
        return cache

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

    def count(self, indices) -> None:
        """Add the lookups of ``indices`` (checked already) to the frequency table."""
        xp = array_module(self.freq_keys)
        indices = xp.asarray(indices, dtype=np.int64)
        if xp is not np:
            # the counting kernel does not depend on the shape: a small module's copy serves
            # shapes too large for the TT kernels as well
            _launch(_COUNT_SHAPE, "tt_count", (max(1, min(4096, -(-indices.size // 256))),),
                    (256,), (indices, np.int64(indices.size), self.freq_keys,
                             self.freq_counts, np.int64(self.freq_keys.size)))
            return
        _count_host(self.freq_keys, self.freq_counts, indices)

    def populate(self, cores) -> None:
        """Cache the ``capacity`` most frequent rows (ties: the smaller id), keeping the dense
        values and state of rows already cached, from the cores' values for new ones."""
        self.populate_from(cores, _to_host(self.freq_keys), _to_host(self.freq_counts))

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
        kept, at = _find_sorted(_to_host(self.rows), chosen)
        kept_slots, fresh = np.flatnonzero(kept), np.flatnonzero(~kept)
        weight = np.zeros((self.capacity, self.shape.dim), dtype=np.float32)
        weight[kept_slots] = _to_host(self.weight)[at[kept]]
        state = {}
        for k, v in self.state.items():
            old = _to_host(v)
            state[k] = np.zeros_like(old)
            state[k][kept_slots] = old[at[kept]]
        if fresh.size:
            weight[fresh] = _to_host(tt_rows(cores, self.shape, xp.asarray(chosen[fresh])))
        rows = np.full(self.capacity, NO_ROW, dtype=np.int64)
        rows[:len(chosen)] = chosen
        self.rows[...] = xp.asarray(rows)
        self.key_slots[...] = xp.asarray(_key_slots(_to_host(self.freq_keys), chosen))
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
        rows = _to_host(self.rows)
        used = rows != NO_ROW
        table[array_module(table).asarray(rows[used])] = self.weight[
            array_module(self.weight).asarray(np.flatnonzero(used))]


def _count_host(keys, counts, indices) -> None:
    """:meth:`TTRowCache.count` on NumPy arrays (see :func:`_insert_counts`)."""
    rows, n = np.unique(np.asarray(indices, dtype=np.int64), return_counts=True)
    _insert_counts(keys, counts, rows, n)


def _insert_counts(keys, counts, rows, n) -> None:
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


def _key_slots(freq_keys: np.ndarray, cached_rows: np.ndarray) -> np.ndarray:
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


def _to_host(a) -> np.ndarray:
    return a.get() if is_cupy_array(a) else np.asarray(a)


def tt_cache_grad(cache: TTRowCache, shape: TTShape, residuals, grad_bags):
    """``(grad, touched)``: each cache row's summed gradient (``capacity x dim``, zeros where
    not hit) and whether the batch hit it. On the GPU the sums go through atomic adds (their
    rounding depends on the order); on the CPU they run in batch order."""
    if isinstance(residuals, TTBagPlan):
        indices, bag, w = residuals.indices, residuals.bag_of, _plan_weights(residuals)
    else:
        indices, bag, w = residuals
    xp = array_module(indices)
    slot = cache.slots(indices)
    hits = xp.flatnonzero(slot >= 0)  # a host sync on the GPU: the cache path takes one
    contrib = xp.asarray(grad_bags, dtype=np.float32)[bag[hits]] * w[hits][:, None]
    grad = xp.zeros((cache.capacity, shape.dim), dtype=np.float32)
    _scatter_add(grad, slot[hits], contrib)
    touched = xp.zeros(cache.capacity, dtype=bool)
    touched[slot[hits]] = True
    return grad, touched


def _plan_weights(plan):
    """Each lookup's pooling weight on the kernel path (as the NumPy path computes it)."""
    xp = array_module(plan.bag_of)
    bounds = plan.offsets if plan.include_last_offset else xp.concatenate(
        [plan.offsets, xp.asarray([plan.n], dtype=np.int64)])
    return _lookup_weights(xp.diff(bounds), plan.bag_of, plan.per_sample_weights,
                           "mean" if plan.mean else "sum", plan.n, np.float32).astype(
        np.float32, copy=False)


# ----------------------------------------------------------------------------- CUDA kernels
# The kernel path (xferlib/_kernels/tt.py): a batch sorted by row, rows sharing a prefix
# computed from one prefix product, backward grouped by core row without a dense gradient.

_COUNT_SHAPE = TTShape((2, 2), (1, 1), (1,))
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


def _uses_kernels(shape: TTShape, indices, cores=None) -> bool:
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


def _launch(shape: TTShape, name: str, grid, block, args) -> None:
    import cupy

    _kernel(shape, name)(grid, block, tuple(args), stream=cupy.cuda.get_current_stream())


def _sort_positions(keys, num_keys: int):
    """``(sorted keys, positions, verdict)``: a stable sort on the device, no host sync."""
    import cupy

    from xferlib.rows import _sorted_positions

    # Tile sorts and merges at every batch size: CuPy's argsort (Thrust) would wait for the
    # device, and a training step must not.
    return _sorted_positions(keys, num_keys, cupy.cuda.get_current_stream(),
                             tiled_max=np.iinfo(np.int32).max)


def _clean_verdict():
    """Two device words set to all ones (no bad position found yet)."""
    import cupy

    verdict = cupy.empty(2, dtype=np.uint64)
    verdict.data.memset_async(0xFF, 16, cupy.cuda.get_current_stream())
    return verdict


def _total_core_rows(shape: TTShape) -> int:
    return sum(shape.p_shapes)


def _grad_spans(shape: TTShape) -> list[tuple[int, int]]:
    """Where each core's rows sit in the flat gradient buffer."""
    spans, start = [], 0
    for k in range(shape.d):
        size = shape.core_shape(k)[0] * shape.core_shape(k)[1]
        spans.append((start, start + size))
        start += size
    return spans


def _lead_core(shape: TTShape) -> int:
    """The core whose digit leads the kernels' sort key (LEAD in xferlib/_kernels/tt.py)."""
    return 1 if shape.d == 3 else 0


def _key_name(rows) -> str:
    return "int" if rows.dtype == np.int32 else "long long"


def _core_pointers(cores) -> list:
    return list(cores) + [np.uint64(0)] * (4 - len(cores))


def _gpu_plan(cores, shape: TTShape, indices, offsets, mode, per_sample_weights,
              include_last_offset, check, num_embeddings=None, out=None, cache=None,
              cache_count=False, report=None):
    """Sort and check the batch and (with ``cores``) pool its rows: ``(bags or None, plan)``."""
    import cupy

    from xferlib._kernels.tt import CHUNK, THREADS

    _check_index_array(indices)
    offsets = cupy.asarray(offsets)
    if offsets.ndim != 1 or offsets.size == 0 or offsets.dtype.kind not in "iu":
        raise ValueError("offsets must be a non-empty 1-D integer array")
    if mode not in ("sum", "mean"):
        raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
    n = int(indices.size)
    num_bags = offsets.size - 1 if include_last_offset else offsets.size
    if out is not None:
        _check_out(out, num_bags, shape)
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
    if _lead_core(shape) == 0:  # the sort key is the row
        rows, perm, sort_verdict = _sort_positions(indices, bound)
    else:  # the lead core's digit first (xferlib/_kernels/tt.py); bad rows get a rejected key
        keys = cupy.empty(n, dtype=np.int64)
        _launch(shape, "tt_keys", (max(1, min(4096, -(-n // 256))),), (256,),
                (indices if indices.dtype == np.int64 else indices.astype(np.int64),
                 np.int64(n), np.int64(bound), keys))
        rows, perm, sort_verdict = _sort_positions(keys, shape.num_rows)
    verdict = _clean_verdict()
    n_off = int(offsets.size)
    num_bags = n_off - 1 if include_last_offset else n_off
    _launch(shape, "tt_check_bags", (max(1, min(1024, -(-(n_off + 1) // 256))),), (256,),
            (offsets, np.int64(n_off), np.int32(include_last_offset), np.int64(n),
             sort_verdict, verdict))
    y = None
    if cores is not None:
        y = cupy.empty((n, shape.dim), dtype=np.float32)
        _launch(shape, f"tt_rows<{_key_name(rows)}>", (max(1, -(-n // CHUNK)),), (THREADS,),
                _core_pointers(cores) + [rows, perm, np.int64(n), y, verdict])
        if out is None:
            out = cupy.empty((num_bags, shape.dim), dtype=np.float32)
    else:
        out = None
    bag_of = cupy.empty(n, dtype=np.int64)
    total = num_bags * shape.dim
    slot = None
    if cache is not None and y is not None and (cache.active or cache_count):
        slot = _cache_slots(cache, shape, indices, bound, cache_count)
    _launch(shape, "tt_pool", (max(1, min(65535, -(-total // 256))),), (256,),
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
    _launch(shape, f"tt_cache_slots<{_key_name(indices)}>", (max(1, min(4096, -(-n // 256))),),
            (256,), (indices, np.int64(n), np.int64(bound),
                     cache.rows, np.int64(cache.capacity if cache.active else 0),
                     cache.freq_keys if count else np.uint64(0), cache.freq_counts,
                     np.int64(cache.freq_keys.size), slot if slot is not None else np.uint64(0)))
    return slot


def _gpu_core_grads(cores, shape: TTShape, plan: TTBagPlan, grad_bags, dense: bool):
    """Each touched core row's gradient, in a flat buffer (zeros elsewhere when ``dense``,
    else untouched rows are left unwritten) and the flags of the touched rows."""
    import cupy

    from xferlib._kernels.tt import CHUNK, REDUCE_THREADS, THREADS

    n, d = plan.n, shape.d
    grad_bags = cupy.ascontiguousarray(cupy.asarray(grad_bags, dtype=np.float32))
    if grad_bags.shape != (plan.num_bags, shape.dim):
        raise ValueError(f"bag gradients must have shape {(plan.num_bags, shape.dim)}, got "
                         f"{grad_bags.shape}")
    size = _grad_spans(shape)[-1][1]
    if n == 0:
        tt_check_plan(plan, shape)
        return (cupy.zeros(size, dtype=np.float32) if dense else None), None
    r = shape.padded_ranks
    a_last = math.prod(shape.q_shapes[:-1])
    ubuf = cupy.empty(n * a_last * r[d - 1], dtype=np.float32)
    cbuf = cupy.empty(n * r[d - 1] * shape.q_shapes[-1], dtype=np.float32)
    c0buf = cupy.empty(n * shape.core_shape(0)[1] if d > 2 else 1, dtype=np.float32)
    keys = cupy.empty((d - 1) * n, dtype=np.int32)
    key_name = _key_name(plan.rows)
    weights = plan.per_sample_weights
    _launch(shape, f"tt_bwd_pieces<{key_name}>", (max(1, -(-n // CHUNK)),), (THREADS,),
            _core_pointers(cores) + [
                plan.rows, plan.perm, np.int64(n), plan.bag_of, plan.offsets,
                np.int64(plan.offsets.size), np.int32(plan.include_last_offset),
                weights if weights is not None else np.uint64(0), np.int32(plan.mean),
                grad_bags, ubuf, cbuf, c0buf, keys, plan.verdict])
    keyed = sum(shape.p_shapes) - shape.p_shapes[_lead_core(shape)]
    skeys, items, _ = _sort_positions(keys, keyed + 1)
    grad = (cupy.zeros if dense else cupy.empty)(size, dtype=np.float32)
    touched = cupy.zeros(_total_core_rows(shape), dtype=np.int32)
    _launch(shape, f"tt_reduce<{key_name}>", (_total_core_rows(shape),), (REDUCE_THREADS,),
            _core_pointers(cores) + [plan.rows, np.int64(n), skeys, items, np.int64(keys.size),
                                     ubuf, cbuf, c0buf, grad, touched, plan.verdict])
    return grad, touched
