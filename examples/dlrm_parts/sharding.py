"""Where the collection's tables live under ``torchrun``: xferlib's sharding plan
(``xferlib.collection.plan_sharding``) for the example's tables, balanced by bytes (rows with
their optimizer state) and by the lookups each table is expected to serve.

Every table gets ``pooling`` lookups per sample, so lookups alone would not tell tables
apart; what differs is how many of them hit distinct rows. A Zipf-popular table of a few
rows sees the same rows again and again, a table of millions mostly new ones, and every
distinct row is gathered and updated by its owner once per step. So a table's expected
lookups per sample here are ``pooling * (1 + distinct fraction)``: one unit of work per
routed, pooled lookup, one more per distinct row, the distinct fraction computed from the
click log's Zipf law (``data.ClickLog``) for the global batch.

NumPy only: ``--plan`` prints a plan without torch or a GPU.
"""

from __future__ import annotations

import inspect

import numpy as np

from . import init as initial
from .data import ClickLog

ZIPF_ALPHA = inspect.signature(ClickLog).parameters["alpha"].default
_EXACT_RANKS = 1 << 20  # beyond these ranks a row is drawn at most about once a batch


def distinct_fraction(rows: int, draws: int, alpha: float = ZIPF_ALPHA) -> float:
    """Expected distinct rows among ``draws`` Zipf(``alpha``) draws from a table of ``rows``,
    over ``draws``: the click log's law (rank ``k`` drawn with probability ``F(k + 2) -
    F(k + 1)``, ``F(y) = (y^(1 - alpha) - 1) / ((rows + 1)^(1 - alpha) - 1)``)."""
    rows, draws = int(rows), int(draws)
    if draws < 1 or rows < 1:
        return 1.0
    span = (rows + 1.0) ** (1.0 - alpha) - 1.0

    def cdf(y):
        return (np.asarray(y, np.float64) ** (1.0 - alpha) - 1.0) / span

    exact = min(rows, _EXACT_RANKS)
    p = np.diff(cdf(np.arange(1, exact + 2, dtype=np.float64)))
    distinct = float(-np.expm1(draws * np.log1p(-np.clip(p, 0.0, 1.0 - 1e-16))).sum())
    if rows > exact:  # the tail: each row there is drawn at most about once
        distinct += draws * float(1.0 - cdf(exact + 1))
    return min(distinct, draws) / draws


def expected_lookups(cardinalities, pooling: int, batch_size: int,
                     alpha: float = ZIPF_ALPHA) -> list:
    """Expected lookups per sample of each table: ``pooling * (1 + distinct fraction)``."""
    draws = int(batch_size) * int(pooling)
    return [pooling * (1.0 + distinct_fraction(n, draws, alpha)) for n in cardinalities]


def table_configs(preset, plan, device_type: str):
    """The collection's TableConfigs (every table but TT ones), named ``t<index>``, each at
    its planned placement, the same configs the one-process run builds."""
    from xferlib.collection import TableConfig

    return [TableConfig(t.rows, preset.dim, name=f"t{t.index}", placement=t.where,
                        cache_rows=t.cache_rows if device_type == "cuda" else 0,
                        init=initial.table_init_spec(preset))
            for t in plan.tables if t.where != "tt"]


def sharding_plan(preset, plan, world: int, *, optimizer: str, pooling: int,
                  batch_size: int, device_type: str = "cpu", row_wise=()):
    """xferlib's plan of the collection over ``world`` ranks: table-wise, balanced by bytes
    and expected lookups; the tables named in ``row_wise`` split by rows over the ranks.
    None when the placement has TT tables (they stay replicated modules)."""
    from xferlib.collection import plan_sharding

    if any(t.where == "tt" for t in plan.tables):
        return None
    configs = table_configs(preset, plan, device_type)
    lookups = expected_lookups([c.num_rows for c in configs], pooling, batch_size)
    return plan_sharding(configs, world, optimizer=optimizer,
                         optimizer_kwargs={"lr": preset.lr_embedding},
                         expected_lookups=lookups, row_wise=tuple(row_wise))
