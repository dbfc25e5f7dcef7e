"""TT cores to start from: FBTT-Embedding's random draws (:func:`init_tt_cores`) and the
TT-SVD compression of a trained dense table (:func:`tt_from_dense`)."""

from __future__ import annotations

import math

import numpy as np

from xferlib.sizes import integral_size
from xferlib.tt.shape import TTShape

__all__ = ["init_tt_cores", "normal_tail", "tt_from_dense", "WEIGHT_DISTS"]

# init_tt_cores' distributions (FBTT's names; "approx-normal" is FBTT's default).
WEIGHT_DISTS = ("approx-normal", "normal", "uniform", "naive-uniform", "approx-uniform")


def init_tt_cores(shape: TTShape, weight_dist: str = "approx-normal", num_embeddings=None,
                  rng=None) -> list[np.ndarray]:
    """Float32 cores drawn as FBTT-Embedding draws them.

    ``uniform``: i.i.d. U(0, s) with ``s = (2 / (N + D)) ** (1 / (2 d)) * prod(R ** (-1 / (2 d)))``.
    ``naive-uniform``: i.i.d. U(0, 1 / sqrt(N)) (FBTT's code takes it; its README omits it).
    ``normal``: i.i.d. N(0, 1 / sqrt(N)). ``approx-normal``: N(0, 1) draws kept only where
    ``|x| >= 2`` (redrawn otherwise), times ``(1 / sqrt(3 N)) ** (1 / 3)``: FBTT's definition,
    drawn here straight from that tail (:func:`normal_tail`, about twice ``normal``'s time
    where redrawing took a hundred times it). ``approx-uniform`` (3 cores): FBTT's saw-tooth
    construction, so that rows of the full table look uniform. ``N`` is ``num_embeddings``
    (default: the table's rows). Vectorized: seconds, not minutes, for large cores; the same
    ``rng`` state gives the same cores.
    """
    if not isinstance(shape, TTShape):
        raise TypeError(f"init_tt_cores takes a TTShape, got {type(shape).__name__} "
                        f"{shape!r}: build it first, e.g. init_tt_cores(TTShape(p_shapes, "
                        f"q_shapes, ranks))")
    rng = np.random.default_rng() if rng is None else rng
    n_rows = (shape.num_rows if num_embeddings is None
              else integral_size("num_embeddings", num_embeddings))
    d, ranks = shape.d, np.asarray(shape.padded_ranks, dtype=np.float64)
    if weight_dist == "uniform":
        stddev = math.sqrt(2.0 / (n_rows + shape.dim))
        core_stddev = stddev ** (1.0 / d) * np.prod(ranks ** (-1.0 / (2 * d)))
        return [rng.uniform(0.0, core_stddev, shape.core_shape(k)).astype(np.float32)
                for k in range(d)]
    if weight_dist == "naive-uniform":
        return [rng.uniform(0.0, 1.0 / math.sqrt(n_rows), shape.core_shape(k)).astype(np.float32)
                for k in range(d)]
    if weight_dist == "normal":
        return [rng.normal(0.0, 1.0 / math.sqrt(n_rows), shape.core_shape(k)).astype(np.float32)
                for k in range(d)]
    if weight_dist == "approx-normal":
        scale = (1.0 / math.sqrt(3 * n_rows)) ** (1.0 / 3.0)
        cores = []
        for k in range(d):
            core = np.empty(shape.core_shape(k), dtype=np.float32)
            normal_tail(rng, core, bound=2.0, scale=scale)
            cores.append(core)
        return cores
    if weight_dist == "approx-uniform":
        return _approx_uniform(shape, n_rows, rng)
    raise ValueError(f"weight_dist must be one of {', '.join(map(repr, WEIGHT_DISTS))}, got "
                     f"{weight_dist!r}")


# Elements drawn per pass of normal_tail: its float64 temporaries stay near 50 MB whatever the
# core's size, and the draws do not depend on the core's size beyond the chunk (reproducible).
TAIL_CHUNK = 1 << 20


def normal_tail(rng, out: np.ndarray, bound: float = 2.0, scale: float = 1.0) -> np.ndarray:
    """Fill ``out`` with ``scale * x``, ``x`` a standard normal draw conditioned on ``|x| >=
    bound``: the distribution of drawing N(0, 1) and redrawing until ``|x| >= bound`` (FBTT's
    ``approx-normal``), without its redraws. That loop keeps one draw in 22 at ``bound = 2``
    and, done element by element or over the whole core per pass, took minutes for large
    cores.

    Each ``|x|`` comes from Marsaglia's tail method (1964): ``x = sqrt(bound^2 - 2 ln U1)``
    has density proportional to ``x exp(-x^2 / 2)`` beyond ``bound``; keeping it when ``U2 x <
    bound`` leaves exactly the normal density ``exp(-x^2 / 2)`` there (84% kept at ``bound
    = 2``); a third uniform gives the sign. Loop-free within a chunk of :data:`TAIL_CHUNK`
    elements; the few rejected ones are drawn again for that chunk.

    >>> out = np.empty(1000, np.float32)
    >>> bool(np.abs(normal_tail(np.random.default_rng(0), out)).min() >= 2)
    True
    """
    if bound <= 0:
        raise ValueError(f"bound must be > 0, got {bound}")
    if not out.flags.c_contiguous:  # reshape would copy, and out would stay unfilled
        raise ValueError("out must be C-contiguous (it is filled in place)")
    flat = out.reshape(-1)
    for start in range(0, flat.size, TAIL_CHUNK):
        view = flat[start:start + TAIL_CHUNK]
        filled = 0
        while filled < view.size:
            need = view.size - filled
            draw = need + need // 4 + 64  # enough for one pass most of the time
            # 1 - U lies in (0, 1]: log1p(-U) is finite
            x = np.sqrt(bound * bound - 2.0 * np.log1p(-rng.random(draw)))
            x = x[rng.random(draw) * x < bound][:need]
            view[filled:filled + x.size] = x * scale
            filled += x.size
        np.negative(view, out=view, where=rng.random(view.size) < 0.5)
    return out


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
