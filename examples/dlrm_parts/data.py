"""A synthetic click log with planted structure, reproducible from ``(seed, step)``.

Every number is a counter-based hash of ``(seed, purpose, step, element)`` (splitmix64), so a
batch is a pure function of its step: no generator state to save, the same bits from NumPy
(the CPU) and CuPy (the GPU, where it is generated next to the model), and a resumed run
sees exactly the batches it would have seen.

What a sample holds:

- 13 dense features, N(0, 1);
- 26 categorical features, each a bag of ``pooling`` rows of its table: a Zipf(``alpha``)
  rank drawn by inverting the continuous power law, then scattered over the table by a fixed
  affine permutation ``row = (a * rank + b) mod n`` (``gcd(a, n) = 1``), so hot rows are not
  the first rows;
- a label drawn from a hidden model: ``logit = c + w . x + 0.5 * x0 * x1 + sum_f bias_f(row)
  + scale * sum_{f < g in S} <z_f(row), z_g(row)>`` with per-row biases and latent vectors
  (also hashes of ``(seed, feature, row)``, so a table of tens of millions of rows costs no
  memory). The same logits give the evaluation set's ``oracle_auc``.

>>> import numpy as np
>>> log = ClickLog([10, 20] + [5] * 24, seed=1)
>>> a, b = log.batch(7, 4, np), log.batch(7, 4, np)
>>> bool((a.cat == b.cat).all()) and a.cat.shape == (26, 4, 1)
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

NUM_DENSE = 13
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# Purposes: each quantity hashes its own stream.
_DENSE, _CAT, _LABEL, _BIAS, _LATENT, _INIT, _EVAL = range(1, 8)
EVAL_STEP_BASE = 1 << 40  # evaluation batches live far from training steps


def _mix(x, xp):
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _key(*parts) -> int:
    """A 64-bit stream key from integers (Python ints: no overflow warnings)."""
    mask, key = (1 << 64) - 1, 0x243F6A8885A308D3
    for p in parts:
        x = ((key ^ (int(p) & mask)) * 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        key = x ^ (x >> 31)
    return key


def hash_uniform(key, counters, xp):
    """U(0, 1) float32, never 0 or 1, one per uint64 counter."""
    key = xp.uint64(key) if isinstance(key, int) else key  # one key, or one per step
    if xp is not np:  # CuPy: one kernel, the same bits as the array operations
        return gpu_hashes().uniform(counters, key)
    return uniform_ops(key, counters, xp)


def hash_normal(key, counters, xp):
    """N(0, 1) float32 (Box-Muller on two hashed uniforms)."""
    key = xp.uint64(key) if isinstance(key, int) else key
    if xp is not np:
        return gpu_hashes().normal(counters, key)
    return normal_ops(key, counters, xp)


def uniform_ops(key, counters, xp):
    """:func:`hash_uniform` as array operations (NumPy's path)."""
    h = _mix(counters * _GOLDEN ^ key, xp)
    return ((h >> np.uint64(40)).astype(xp.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)


def normal_ops(key, counters, xp):
    """:func:`hash_normal` as array operations (NumPy's path)."""
    u1 = uniform_ops(key, counters * np.uint64(2), xp)
    u2 = uniform_ops(key, counters * np.uint64(2) + np.uint64(1), xp)
    return xp.sqrt(np.float32(-2.0) * xp.log(u1)) * xp.cos(np.float32(2 * math.pi) * u2)


def rank_rows_ops(u, span, n, a, b, alpha, xp):
    """Rows from uniforms ``u``: the power law's inverse CDF (ranks ``0 .. n-1``), scattered
    by ``(a * rank + b) mod n`` (NumPy's path; broadcasting over the feature axis)."""
    rank = xp.floor((span * u.astype(xp.float64) + 1.0) ** (1.0 / (1.0 - alpha))) - 1.0
    rank = xp.minimum(xp.maximum(rank, 0.0), n.astype(xp.float64) - 1).astype(xp.uint64)
    return ((a * rank + b) % n).astype(xp.int64)


# On a GPU each hash (and a batch's rows) is one kernel instead of a dozen array operations:
# a chunk of batches took ~150 launches, whose host time bounds a run that dispatches from
# Python. The arithmetic is the array operations', operation for operation in the same
# precision; double-precision products and sums use _rn intrinsics so that the compiler fuses
# none into an FMA (rounded once instead of twice, which the separate operations are not).
_GPU_PREAMBLE = r"""
__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
    x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27; x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
__device__ __forceinline__ float unit(unsigned long long key, unsigned long long c) {
    const unsigned long long h = mix64((c * 0x9E3779B97F4A7C15ull) ^ key);
    return ((float)(h >> 40) + 0.5f) * 5.9604644775390625e-08f;
}
"""
_GPU_HASHES = []


def gpu_hashes():
    """The CuPy kernels (compiled on first use): ``uniform(counters, key)``,
    ``normal(counters, key)``, ``rows(counters, key, span, n, a, b, expo)``."""
    if not _GPU_HASHES:
        from types import SimpleNamespace

        import cupy

        def kernel(name, inputs, output, body):
            return cupy.ElementwiseKernel(inputs, output, body, name, preamble=_GPU_PREAMBLE)

        _GPU_HASHES.append(SimpleNamespace(
            uniform=kernel("click_uniform", "uint64 c, uint64 key", "float32 out",
                           "out = unit(key, c);"),
            normal=kernel("click_normal", "uint64 c, uint64 key", "float32 out",
                          "out = sqrtf(-2.0f * logf(unit(key, c * 2ull)))"
                          " * cosf(6.2831854820251465f * unit(key, c * 2ull + 1ull));"),
            rows=kernel("click_rows", "uint64 c, uint64 key, float64 span, uint64 n, "
                        "uint64 a, uint64 b, float64 expo", "int64 out",
                        "double r = floor(pow(__dadd_rn(__dmul_rn(span, (double)unit(key, c)),"
                        " 1.0), expo)) - 1.0;"
                        "r = fmin(fmax(r, 0.0), (double)n - 1.0);"
                        "out = (long long)((a * (unsigned long long)r + b) % n);")))
    return _GPU_HASHES[0]


def _coprime_multiplier(n: int, f: int) -> int:
    a = (0x5DEECE66D + 7919 * f) % max(n, 1) or 1
    while math.gcd(a, n) != 1:
        a += 1
    return a


@dataclass
class Batch:
    dense: object   # (B, 13) float32
    cat: object     # (26, B, pooling) int64 rows
    label: object   # (B,) float32 in {0, 1}
    logit: object   # (B,) float32, the hidden model's logit (the oracle's score)


class ClickLog:
    """The click log of one configuration; ``batch(step, B, xp)`` draws training batch
    ``step`` with NumPy or CuPy (``xp``); ``eval_batch(i, B, xp)`` the i-th evaluation
    batch."""

    def __init__(self, cardinalities, *, seed: int = 0, pooling: int = 1, alpha: float = 1.05,
                 latent_features=None, latent_dim: int = 4, bias_features=None):
        self.cardinalities = [int(n) for n in cardinalities]
        self.seed, self.pooling, self.alpha = int(seed), int(pooling), float(alpha)
        if self.pooling < 1:
            raise ValueError(f"pooling must be >= 1, got {pooling}")
        if abs(self.alpha - 1.0) < 1e-6:
            raise ValueError("alpha must differ from 1 (the inverse CDF used is 1/(1-alpha))")
        F = len(self.cardinalities)
        self.latent_features = list(range(0, F, 3) if latent_features is None
                                    else latent_features)
        self.bias_features = list(range(1, F, 2) if bias_features is None else bias_features)
        self.latent_dim = int(latent_dim)
        n = np.array(self.cardinalities, np.float64)
        self._n = np.array(self.cardinalities, np.uint64)
        self._a = np.array([_coprime_multiplier(c, f) for f, c in enumerate(self.cardinalities)],
                           np.uint64)
        self._b = np.array([(0x2545F491 * (f + 1)) % c for f, c in enumerate(self.cardinalities)],
                           np.uint64)
        # the power law's inverse CDF on [1, n + 1): ranks 0 .. n-1
        self._span = (n + 1.0) ** (1.0 - self.alpha) - 1.0
        rng = np.random.default_rng([self.seed, 12])
        self._w = (rng.standard_normal(NUM_DENSE) * 0.8 / math.sqrt(NUM_DENSE)).astype(np.float32)
        pairs = len(self.latent_features) * (len(self.latent_features) - 1) / 2
        self._pair_scale = np.float32(1.4 / math.sqrt(max(pairs, 1.0)))
        self._bias_scale = np.float32(0.9 / math.sqrt(max(len(self.bias_features), 1)))
        self._consts = {}

    def _on(self, xp):
        if xp not in self._consts:
            self._consts[xp] = {k: xp.asarray(v) for k, v in dict(
                n=self._n, a=self._a, b=self._b, span=self._span, w=self._w).items()}
        return self._consts[xp]

    def _rows(self, keys, B: int, xp, lo: int, hi: int):
        c, F, L = self._on(xp), len(self.cardinalities), self.pooling
        # element (f, b, l) of the whole batch, for samples lo <= b < hi; one key per step
        counters = (xp.arange(F, dtype=xp.uint64)[:, None, None] * np.uint64(B * L)
                    + xp.arange(lo * L, hi * L, dtype=xp.uint64).reshape(1, hi - lo, L))
        f = {k: c[k][:, None, None] for k in ("span", "n", "a", "b")}  # per feature
        keys = keys[:, None, None, None]
        if xp is not np:  # one kernel, the same bits as the array operations
            return gpu_hashes().rows(counters, keys, f["span"], f["n"], f["a"], f["b"],
                                     1.0 / (1.0 - self.alpha))
        return rank_rows_ops(uniform_ops(keys, counters, xp), f["span"], f["n"], f["a"],
                             f["b"], self.alpha, xp)

    def row_bias(self, features, rows, xp):
        """Per-row biases of ``features`` (a list): ``rows[..., j, :, :]`` holds rows of table
        ``features[j]`` (axes ``(..., feature, sample, pooling)``). One set of kernels for
        every feature: a launch per feature made data generation launch-bound on a GPU."""
        keys = self._feature_keys(_BIAS, features, xp)
        return hash_normal(keys[:, None, None], rows.astype(xp.uint64), xp)

    def row_latent(self, features, rows, xp):
        """Latent vectors (a trailing axis of ``latent_dim``) of ``features``' rows, laid out
        as for :meth:`row_bias`."""
        k = self.latent_dim
        counters = rows.astype(xp.uint64)[..., None] * np.uint64(k) + xp.arange(k, dtype=xp.uint64)
        keys = self._feature_keys(_LATENT, features, xp)
        return hash_normal(keys[:, None, None, None], counters, xp)

    def _feature_keys(self, purpose: int, features, xp):
        name = (purpose, tuple(features))
        consts = self._on(xp)
        if name not in consts:
            consts[name] = xp.asarray(np.array([_key(self.seed, purpose, f) for f in features],
                                               np.uint64))
        return consts[name]

    def _keys(self, steps, purpose: int, what: int, xp):
        return xp.asarray(np.array([_key(self.seed, purpose, what, s) for s in steps],
                                   np.uint64))

    def _make(self, steps, B: int, xp, purpose: int, lo: int = 0,
              hi: int | None = None) -> Batch:
        """The batches of ``steps`` (a list), stacked on a leading axis: one set of kernels
        for all of them."""
        c = self._on(xp)
        hi = B if hi is None else hi
        counters = xp.arange(lo * NUM_DENSE, hi * NUM_DENSE,
                             dtype=xp.uint64).reshape(hi - lo, NUM_DENSE)
        dense = hash_normal(self._keys(steps, purpose, _DENSE, xp)[:, None, None], counters, xp)
        cat = self._rows(self._keys(steps, purpose, _CAT, xp), B, xp, lo, hi)  # (S, F, B, L)
        logit = (dense @ c["w"] + np.float32(0.5) * dense[..., 0] * dense[..., 1]
                 - np.float32(1.0))
        if self.bias_features:  # (S, features, B, L) -> (S, B)
            bias = self.row_bias(self.bias_features, cat[:, self.bias_features], xp)
            logit = logit + self._bias_scale * bias.mean(axis=-1).sum(axis=1)
        if len(self.latent_features) > 1:
            z = self.row_latent(self.latent_features, cat[:, self.latent_features], xp)
            z = z.mean(axis=-2).transpose(0, 2, 1, 3)  # (S, B, features, k)
            total = z.sum(axis=-2)
            pairs = ((total * total).sum(-1) - (z * z).sum(axis=(-2, -1))) * np.float32(0.5)
            logit = logit + self._pair_scale * pairs / np.float32(math.sqrt(self.latent_dim))
        u = hash_uniform(self._keys(steps, purpose, _LABEL, xp)[:, None],
                         xp.arange(lo, hi, dtype=xp.uint64), xp)
        label = (u < 1.0 / (1.0 + xp.exp(-logit))).astype(xp.float32)
        return Batch(dense.astype(xp.float32), cat, label, logit.astype(xp.float32))

    def batches(self, first_step: int, count: int, batch_size: int, xp=np,
                part=None) -> Batch:
        """Training batches ``first_step .. first_step + count - 1`` made together (each
        array with a leading axis of ``count``): the kernels of one batch, launched once for
        ``count`` steps. ``batches(s, n, B)`` and ``batch(s + i, B)`` draw the same samples
        (equal up to float rounding in the labels' logits). ``part``: as :meth:`batch`."""
        steps = list(range(int(first_step), int(first_step) + int(count)))
        return self._make(steps, int(batch_size), xp, 0, *_samples(batch_size, part))

    def batch(self, step: int, batch_size: int, xp=np, part=None) -> Batch:
        """Training batch ``step`` (any step, in any order: a pure function). ``part=(rank,
        world)``: only that rank's contiguous share of the samples (``batch_size`` is the
        global batch and a multiple of ``world``), equal to that slice of the whole batch."""
        return _first(self._make([int(step)], int(batch_size), xp, 0,
                                 *_samples(batch_size, part)))

    def eval_batch(self, i: int, batch_size: int, xp=np) -> Batch:
        """The ``i``-th batch of the held-out evaluation set (a stream no training step
        draws)."""
        return _first(self._make([EVAL_STEP_BASE + int(i)], int(batch_size), xp, _EVAL))


def _samples(batch_size: int, part) -> tuple:
    """``(lo, hi)``: the samples of the global batch that ``part=(rank, world)`` makes (all
    of them for None)."""
    B = int(batch_size)
    if part is None:
        return 0, B
    rank, world = (int(v) for v in part)
    if world < 1 or not 0 <= rank < world or B % world:
        raise ValueError(f"part=(rank, world) needs 0 <= rank < world and a batch size "
                         f"divisible by world; got {part} for batch {B}")
    share = B // world
    return rank * share, (rank + 1) * share


def _first(batch: Batch) -> Batch:
    return Batch(*(a[0] for a in (batch.dense, batch.cat, batch.label, batch.logit)))


def init_rows(seed: int, table: int, start: int, stop: int, dim: int, scale: float, xp=np):
    """Initial weights of rows ``[start, stop)`` of table ``table``: U(-scale, scale), a pure
    function of ``(seed, table, row, column)``, so every framework and placement starts
    from the same values whatever order the rows are made in."""
    counters = (xp.arange(start, stop, dtype=xp.uint64)[:, None] * np.uint64(dim)
                + xp.arange(dim, dtype=xp.uint64))
    u = hash_uniform(_key(seed, _INIT, table), counters, xp)
    return (u * np.float32(2 * scale) - np.float32(scale)).astype(xp.float32)
