"""Checkpoints of sharded collections: each rank writes its shards' files, rank 0 the
manifest; a checkpoint loads onto any plan and group size, or into one process."""

from __future__ import annotations

import os

import torch.distributed as dist

from xferlib.adapters.torch.collection import EmbeddingBagCollection
from xferlib.adapters.torch.collection_dist import ShardedEmbeddingBagCollection
from xferlib.collection.sharding import (plan_sharding, read_checkpoint, read_rows,
                                         save_shard_files, shard_arrays, write_manifest)

__all__ = ["load_sharded", "save_sharded"]


def _shards_and_collection(module):
    """``(plan-like shards, core collection)`` of a sharded module or of an unsharded
    EmbeddingBagCollection (every table one whole shard)."""
    if isinstance(module, ShardedEmbeddingBagCollection):
        coll = None if module.local is None else module.local.collection
        return module.plan.shards_of(module.rank), coll
    if isinstance(module, EmbeddingBagCollection):
        plan = plan_sharding(module.tables, 1, optimizer=module.collection.optimizer)
        return plan.shards, module.collection
    raise TypeError(f"expected a ShardedEmbeddingBagCollection or an EmbeddingBagCollection, "
                    f"got {type(module).__name__}")


def _raise_together(module, error, others: str) -> None:
    """Every rank of ``module``'s group learns whether any rank failed: the failed rank
    raises its ``error``, the others RuntimeError(``others``), so none goes on alone."""
    every = [None] * module.world_size
    dist.all_gather_object(every, [error is None], group=module.group)
    if error is not None:
        raise error
    if not all(ok[0] for ok in every):
        raise RuntimeError(others)


def save_sharded(module: ShardedEmbeddingBagCollection, directory, tag: str = "") -> None:
    """Write ``module``'s checkpoint into ``directory`` (collective: every rank calls it):
    each rank writes one file per shard it holds (crash-safe), then rank 0 writes the
    manifest that names them (last, so an interrupted save leaves the previous manifest
    and its files whole; give each save its own ``tag``, such as the step, to keep the
    previous files until the new manifest is in place)."""
    os.makedirs(directory, exist_ok=True)
    arrays = {}
    if module.local is not None:
        coll = module.local.collection
        with module.local._on_device():
            arrays = shard_arrays(coll.state_dict(), module.shards,
                                  ("weight", *coll.state_names()))
    error = None
    try:
        save_shard_files(directory, module.plan, module.rank, arrays, tag)
    except OSError as err:
        error = err
    _raise_together(module, error, "another rank failed to write its shards; no manifest "
                                   "written")
    if module.rank == 0:
        try:
            write_manifest(directory, module.plan,
                           dict(optimizer=module.optimizer, pooling=module.pooling,
                                dtype=str(module.dtype).replace("torch.", "")), tag)
        except OSError as err:
            error = err
    # Every rank learns whether the manifest was written (a barrier here would be met by
    # rank 0's next collective after it raised alone, and the others would return as if
    # the checkpoint were complete).
    done = [error is None]
    dist.broadcast_object_list(done, src=dist.get_global_rank(module.group, 0),
                               group=module.group)
    if error is not None:
        raise error
    if not done[0]:
        raise RuntimeError("rank 0 failed to write the checkpoint manifest; the checkpoint "
                           "is incomplete")


def load_sharded(module, directory) -> None:
    """Load the checkpoint in ``directory`` into ``module``: a
    :class:`ShardedEmbeddingBagCollection` of any plan and group size (each rank reads the
    rows of its shards from whichever saved shards hold them), or an unsharded
    :class:`EmbeddingBagCollection` (every table whole, in one process). The tables'
    names, rows and widths and the optimizer must match. Hyperparameters are the loading
    module's own.

    Collective for a sharded module (every rank calls it): each rank reads its rows, the
    ranks learn whether all of them could, and only then does any rank write; a rank that
    could not read raises its own error, the others a RuntimeError, and no table changes."""
    sharded = isinstance(module, ShardedEmbeddingBagCollection)
    error, state, coll = None, {}, None
    try:
        tables = module.tables
        optimizer = module.optimizer if sharded else module.collection.optimizer
        manifest = read_checkpoint(directory, tables, optimizer)
        shards, coll = _shards_and_collection(module)
        for s in shards if coll is not None else ():
            rows = read_rows(directory, manifest, s.table, s.row_start, s.row_stop)
            state.update({f"{s.local_name}.{k}": v for k, v in rows.items()})
        if coll is not None:
            coll.check_state_dict(state)  # shapes and values, before any rank writes
    except Exception as err:  # noqa: BLE001 - any failure, raised after the ranks agree
        if not sharded:
            raise
        error = err
    if sharded:
        _raise_together(module, error, "another rank could not read its rows of the "
                                       "checkpoint; no table was changed")
    if coll is None:
        return
    device = module.local if sharded else module
    with device._on_device():
        coll.load_state_dict(state)
