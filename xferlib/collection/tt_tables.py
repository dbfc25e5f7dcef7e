"""A collection's ``tt`` tables: each is an :class:`xferlib.tt.TTTable` (its cores, optimizer
state and step counter), looked up and trained by the collection's step.

Forward: each tt table's bags are pooled by its TT table from the table's slice of the batch
and written into its columns of the pooled output. Backward: the pooled gradient's columns of
each tt table go to its :meth:`~xferlib.tt.TTTable.apply_gradients` (the fused TT backward and
optimizer, FBGEMM's rule on the core rows the batch touched). The collection's optimizer runs
on tt tables when TT has it (:data:`TT_COLLECTION_OPTIMIZERS`), with the table's learning
rate and the optimizer's ``eps``; options TT does not have (momentum, weight decay, ...) are
refused for a collection with tt tables.

The NumPy path slices each table's lookups. The GPU path does not read the offsets on the
host (no host sync): a tt table's batch is the whole batch with the other tables' lookups
turned into row 0 (weight 0 where the batch has per-sample weights), kept in a first and a
last extra bag whose gradient is zero (``offsets`` ``[0, offsets[t B] .. offsets[(t + 1)
B], n]``). A zero gradient leaves the rules TT runs here exactly where they were (``sgd``,
``adagrad``, ``rowwise_adagrad`` with ``eps > 0``; with finite cores: a non-finite value in
a core's row 0 spreads to its gradient through the extra bags). The collection's input
check covers the tt tables' indices; until it is read, a batch it refuses reaches the TT
table with every lookup in the last extra bag, so the TT step writes nothing new, and its
count is taken back on the device. Each tt table's kernels thus see the whole batch: a cost
of the missing host sync.

State: ``"<table>.core<k>"`` (core ``k``, float32), ``"<table>.core<k>.<state>"`` (its
optimizer state, as :func:`xferlib.tt.tt_sparse_state` makes it) and ``"<table>.step"`` (the
table's step counter, one int64: the collection steps it took part in).
"""

from __future__ import annotations

import numpy as np

from xferlib.table.rules import SPARSE_OPTIMIZERS as _TABLE_OPTIMIZERS
from xferlib.table.rules import resolve_hyper
from xferlib.tt.rules import SPARSE_OPTIMIZERS as _TT_OPTIMIZERS
from xferlib.tt.table import resolve_tt_hyper

__all__ = ["TT_COLLECTION_OPTIMIZERS", "tt_hyper", "build_tt_tables", "tt_state_arrays",
           "tt_state_shapes", "tt_lookup_numpy", "tt_update_numpy", "tt_lookup_gpu",
           "tt_update_gpu", "tt_bytes"]

# The collection's optimizers that TT tables run too (same name, FBGEMM's rule on core rows).
TT_COLLECTION_OPTIMIZERS = tuple(o for o in _TABLE_OPTIMIZERS if o in _TT_OPTIMIZERS)
_TT_HYPER = ("lr", "eps")  # what the TT rules above take of the collection's hyperparameters


def tt_hyper(name: str, optimizer: str, hyper: dict) -> dict:
    """A tt table's TT hyperparameters (``lr``, ``eps``) from its collection
    hyperparameters; ValueError naming the table for an optimizer TT does not run here, an
    option it does not have set away from its default, or an adagrad ``eps`` that is not
    > 0 (a core row with a zero gradient would turn to NaN)."""
    if optimizer not in TT_COLLECTION_OPTIMIZERS:
        raise ValueError(f"table {name!r} is placed in 'tt': its TT cores train with one of "
                         f"{TT_COLLECTION_OPTIMIZERS} (the collection optimizers in "
                         f"xferlib.tt.SPARSE_OPTIMIZERS), not {optimizer!r}")
    defaults = resolve_hyper(optimizer, None)
    odd = {k: v for k, v in hyper.items() if k not in _TT_HYPER and v != defaults.get(k)}
    if odd:
        raise ValueError(f"table {name!r} is placed in 'tt', whose {optimizer!r} takes only "
                         f"{list(_TT_HYPER)}; got {odd}")
    out = {k: float(hyper[k]) for k in _TT_HYPER if k in hyper}
    if optimizer != "sgd" and not out.get("eps", 0.0) > 0:
        raise ValueError(f"table {name!r} is placed in 'tt': {optimizer!r} needs eps > 0, "
                         f"got {out.get('eps')}")
    try:  # the TT table's own checks (finite lr and eps), here: before anything changes
        resolve_tt_hyper(out)
    except ValueError as err:
        raise ValueError(f"table {name!r} (tt): {err}") from None
    return out


def build_tt_tables(coll, seed: int, hypers: dict) -> dict:
    """``{t: TTTable}`` for the tt tables of ``coll`` (``hypers``: each one's
    :func:`tt_hyper`): cores drawn from the table's stream of ``seed`` (the same cores on
    the CPU and the GPU), or zeros for ``init="zeros"``; on the GPU in CuPy arrays of the
    current device."""
    from xferlib.collection.init import table_stream
    from xferlib.tt.table import TTTable

    out = {}
    for t, config in enumerate(coll.tables):
        if config.placement != "tt":
            continue
        if coll.device == "cuda":
            import cupy as xp
        else:
            xp = np
        table = TTTable(config.tt_shape, coll.optimizer, hypers[t],
                        num_embeddings=config.num_rows, init=config.tt_init,
                        seed=table_stream(seed, t), xp=xp)
        if config.init in ("zeros", ("zeros",)):
            for core in table.cores:
                core[...] = 0
        out[t] = table
    return out


# ------------------------------------------------------------------ state


def tt_state_arrays(table, name: str) -> dict:
    """The tt table's arrays by state_dict key (the table's own arrays, not copies)."""
    out = {}
    for k, (core, state) in enumerate(zip(table.cores, table.states)):
        out[f"{name}.core{k}"] = core
        out.update({f"{name}.core{k}.{key}": value for key, value in state.items()})
    out[f"{name}.step"] = table.step_array
    return out


def tt_state_shapes(table, name: str) -> dict:
    """``{key: shape}`` of :func:`tt_state_arrays` (nothing read from the device)."""
    return {key: tuple(value.shape) for key, value in tt_state_arrays(table, name).items()}


def tt_bytes(tables: dict) -> int:
    """Bytes of the tt tables' cores, optimizer state and step counters."""
    return sum(int(a.nbytes) for table in tables.values()
               for a in tt_state_arrays(table, "").values())


# ------------------------------------------------------------------ the NumPy path


def tt_lookup_numpy(coll, indices, offsets, per_sample_weights, B, out) -> dict:
    """Each tt table's bags of a checked NumPy batch, written into its columns of ``out``;
    returns ``{t: TTResiduals}``."""
    residuals = {}
    for t, table in coll.tt_tables.items():
        lo, hi = int(offsets[t * B]), int(offsets[(t + 1) * B])
        local = np.asarray(offsets[t * B:(t + 1) * B + 1], dtype=np.int64) - lo
        weights = (None if per_sample_weights is None
                   else np.asarray(per_sample_weights[lo:hi], dtype=np.float32))
        bags, residuals[t] = table.lookup(indices[lo:hi], local, per_sample_weights=weights,
                                          mode=coll.pooling, include_last_offset=True)
        out[:, coll.dim_offsets[t]:coll.dim_offsets[t + 1]] = bags
    return residuals


def tt_update_numpy(coll, residuals: dict, grad_pooled) -> None:
    """Each tt table's fused TT update from its columns of the pooled gradient."""
    for t, res in residuals.items():
        grad = np.ascontiguousarray(grad_pooled[:, coll.dim_offsets[t]:coll.dim_offsets[t + 1]],
                                    dtype=np.float32)
        coll.tt_tables[t].apply_gradients(res, grad)


# ------------------------------------------------------------------ the GPU path


def tt_lookup_gpu(coll, indices, offsets64, psw, B: int, words, out, stream) -> dict:
    """Each tt table's bags of a GPU batch (queued on ``stream``, CuPy's current stream
    here), written into its columns of ``out``: the whole batch, with the other tables'
    lookups as row 0 in two extra bags, and every lookup in the last extra bag
    while the collection's verdict ``words`` (after its plan) refuse the batch. No host
    sync. Returns ``{t: TTResiduals}``."""
    import cupy

    if not coll.tt_tables:
        return {}
    n = int(indices.shape[0])
    ok = (~words == 0).all()  # the collection's check passed (a device scalar)
    position = cupy.arange(n, dtype=np.int64)
    first, last = cupy.zeros(1, dtype=np.int64), cupy.full(1, n, dtype=np.int64)
    residuals = TTLookups(ok)
    for t, table in coll.tt_tables.items():
        bounds = offsets64[t * B:(t + 1) * B + 1]
        mine = ok & (position >= bounds[:1]) & (position < bounds[-1:])
        # no bag (B == 0): every lookup in the last extra bag, whatever offsets[0] says
        local = cupy.concatenate([first, cupy.where(ok, bounds, 0) if B else first, last])
        weights = (None if psw is None
                   else cupy.where(mine, psw, 0).astype(np.float32, copy=False))
        bags, residuals[t] = table.lookup(cupy.where(mine, indices, 0), local,
                                          per_sample_weights=weights, mode=coll.pooling,
                                          include_last_offset=True, train=True,
                                          count_cache=False, stream=stream)
        out[:, coll.dim_offsets[t]:coll.dim_offsets[t + 1]] = bags[1:B + 1]
    return residuals


class TTLookups(dict):
    """``{t: TTResiduals}`` of a GPU batch, and ``ok``: whether the collection's check passed
    (a device scalar)."""

    def __init__(self, ok):
        super().__init__()
        self.ok = ok


def tt_update_gpu(coll, residuals: TTLookups, grad, B: int, stream) -> None:
    """Each tt table's fused TT update (queued on ``stream``, CuPy's current stream here):
    its columns of the pooled gradient as the bags' gradient, zeros for the extra bags. A
    batch the collection refused writes nothing (every lookup sits in the zero-gradient
    last bag) and its count is taken back on the device (the TT table's own check passes
    such a batch, so its GPU step counts it), so a refused batch leaves the step counters
    as they were whether the refusal is read before this update or after it."""
    import cupy

    refused = (~residuals.ok).astype(np.int64)
    for t, res in residuals.items():
        table = coll.tt_tables[t]
        g = cupy.zeros((B + 2, table.dim), dtype=np.float32)
        g[1:B + 1] = grad[:, coll.dim_offsets[t]:coll.dim_offsets[t + 1]]
        table.apply_gradients(res, g, stream=stream)
        table.uncount(refused)
