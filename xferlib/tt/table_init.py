"""A TT table's starting point, apart from :class:`xferlib.tt.TTTable`: the fused rules'
hyperparameters (their defaults and checks) and the first draw of the cores of ``num_tables``
tables of one shape. :mod:`xferlib.tt.table` imports and re-exports every name here.
"""

from __future__ import annotations

import math

import numpy as np

from xferlib.tt.initializers import init_tt_cores
from xferlib.tt.shape import TTShape

__all__ = ["TT_HYPER_DEFAULTS", "resolve_tt_hyper", "draw_tt_tables"]

# The fused rules' hyperparameters and their defaults (FBTT's learning rate and eps, FBGEMM's
# betas, weight decay, LARS eta and momentum).
TT_HYPER_DEFAULTS = {"lr": 0.1, "eps": 1.0e-10, "betas": (0.9, 0.999), "weight_decay": 0.0,
                     "eta": 0.001, "momentum": 0.9}


def resolve_tt_hyper(changes) -> dict:
    """:data:`TT_HYPER_DEFAULTS` updated by ``changes``, checked: ValueError for an unknown
    name or a learning rate or eps that is not a finite number >= 0, TypeError for a value
    that is not a number."""
    changes = dict(changes or {})
    unknown = sorted(set(changes) - set(TT_HYPER_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown hyperparameters {unknown} for a TT table; it takes "
                         f"{sorted(TT_HYPER_DEFAULTS)}")
    hyper = {**TT_HYPER_DEFAULTS, **changes}
    try:
        betas = tuple(float(b) for b in hyper["betas"])
        out = {k: float(v) for k, v in hyper.items() if k != "betas"}
    except (TypeError, ValueError) as err:
        raise TypeError(f"TT hyperparameters must be numbers (betas a pair), got {hyper}") \
            from err
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair of numbers, got {hyper['betas']!r}")
    for name in ("lr", "eps"):
        if not math.isfinite(out[name]) or out[name] < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {hyper[name]!r}")
    out["betas"] = betas
    return out


def draw_tt_tables(shape: TTShape, num_tables: int, weight_dist: str = "approx-normal",
                   num_embeddings=None, seed=None) -> list[np.ndarray]:
    """Float32 cores of ``num_tables`` tables drawn one table after the other from one
    generator seeded with ``seed`` (:func:`xferlib.tt.init_tt_cores`), stacked FBTT's way:
    core ``k`` is ``[num_tables, p_k, width]``."""
    if weight_dist == "approx-uniform" and num_tables != 1:
        raise ValueError("approx-uniform initialization needs num_tables == 1 (as in FBTT)")
    rng = np.random.default_rng(seed)
    tables = [init_tt_cores(shape, weight_dist, num_embeddings, rng=rng)
              for _ in range(num_tables)]
    return [np.stack([t[k] for t in tables]) for k in range(shape.d)]
