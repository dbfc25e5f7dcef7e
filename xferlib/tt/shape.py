"""The factorization of a TT table (:class:`TTShape`), balanced factorizations of row counts
and dimensions, and the checks of index and output arrays against a shape.

Also where each core's rows sit in the flat core-gradient buffer and its touched flags
(:func:`grad_spans`, :func:`total_core_rows`), shared by the array path and the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from xferlib._backend import array_module, is_cupy_array
from xferlib._kernels.tt import lead_core_of
from xferlib.sizes import integral_size, integral_sizes

__all__ = ["TTShape", "suggest_tt_shapes"]


@dataclasses.dataclass(frozen=True)
class TTShape:
    """The factorization of a TT table. ``ranks`` are the inner ranks (``d - 1`` of them).
    Every factor and rank is an integer (a float such as ``16.5`` raises TypeError rather
    than being truncated)."""

    p_shapes: tuple
    q_shapes: tuple
    ranks: tuple

    def __post_init__(self):
        p, q, r = (tuple(integral_sizes(name, x)) for name, x in (
            ("p_shapes", self.p_shapes), ("q_shapes", self.q_shapes), ("ranks", self.ranks)))
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
        expected = core_shapes(self)
        if len(cores) != self.d:
            raise ValueError(f"{self.d} cores expected, got {len(cores)}")
        for k, core in enumerate(cores):
            got = getattr(core, "shape", None)  # arrays; np.shape for nested sequences
            got = tuple(np.shape(core)) if got is None else tuple(got)
            if got != expected[k]:
                raise ValueError(f"core {k} must have shape {expected[k]}, got {got}")


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
    dimensions use ``allow_round_up=False``: the product is exactly ``n`` (128 -> [4, 4, 8];
    rounded up, 128 would become 200 = 5 x 5 x 8, a table of another width).
    """
    n, d = integral_size("n", n), integral_size("d", d)
    if n <= 0 or not 2 <= d <= 4:
        raise ValueError(f"need n > 0 and 2 <= d <= 4, got n={n}, d={d}")
    best = _balanced_factors(n, d)
    if allow_round_up:
        for k in range(1, len(str(n))):
            candidate = _balanced_factors(-(-n // 10 ** k) * 10 ** k, d)
            if _spread(candidate) < _spread(best) - 1e-12:
                best = candidate
    return best


def check_index_array(idx) -> None:
    if idx.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, got {idx.dtype}")
    if idx.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {idx.shape}")


def row_bound(shape: TTShape, num_embeddings=None) -> int:
    """The bound indices must stay below: ``num_embeddings`` (default: every row of the
    factorization), which the factorization must hold (a row past it has no digits in range).

    >>> row_bound(TTShape((2, 3), (2, 2), (2,)), 5)
    5
    """
    if num_embeddings is None:
        return shape.num_rows
    bound = integral_size("num_embeddings", num_embeddings)
    if not 0 <= bound <= shape.num_rows:
        raise ValueError(f"num_embeddings must be between 0 and {shape.num_rows} (the rows the "
                         f"TT factorization holds), got {bound}")
    return bound


def checked_indices(idx, shape: TTShape, num_embeddings=None):
    bound = row_bound(shape, num_embeddings)
    xp = array_module(idx) if is_cupy_array(idx) else np
    idx = xp.asarray(idx)
    check_index_array(idx)
    bad = xp.flatnonzero((idx < 0) | (idx >= bound))
    if bad.size:
        position = int(bad[0])
        raise IndexError(f"index {int(idx[position])} at position {position} is out of range "
                         f"for a TT table of {bound} rows (valid: 0 <= index < {bound})")
    return idx.astype(xp.int64)


def check_out(out, num_bags: int, shape: TTShape) -> None:
    if tuple(out.shape) != (num_bags, shape.dim) or out.dtype != np.float32:
        raise ValueError(f"out must be float32 of shape {(num_bags, shape.dim)}, got "
                         f"{out.dtype} {tuple(out.shape)}")


# Per-shape constants, computed once (a step asks for them several times).


@functools.lru_cache(maxsize=256)
def core_shapes(shape: TTShape) -> tuple:
    """Every core's ``(p_k, R_k q_k R_{k+1})``."""
    return tuple(shape.core_shape(k) for k in range(shape.d))


@functools.lru_cache(maxsize=256)
def total_core_rows(shape: TTShape) -> int:
    return sum(shape.p_shapes)


@functools.lru_cache(maxsize=256)
def grad_spans(shape: TTShape) -> tuple[tuple[int, int], ...]:
    """Where each core's rows sit in the flat gradient buffer."""
    spans, start = [], 0
    for rows, width in core_shapes(shape):
        spans.append((start, start + rows * width))
        start += rows * width
    return tuple(spans)


def lead_core(shape: TTShape) -> int:
    """The core whose digit leads the kernels' sort key (LEAD in xferlib/_kernels/tt.py,
    generated from :func:`xferlib._kernels.tt.lead_core_of`)."""
    return lead_core_of(shape.d)
