"""Where a ``ShardedEmbeddingBagCollection``'s lookups go: the routing tables built from its
:class:`~xferlib.collection.ShardingPlan` (each shard's owner, its slot in the owner's
collection, its first row; each owner's output columns) and, for a batch, each lookup's
owner, slot and index local to its shard, computed on the device without a host sync.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ShardRouting"]


class ShardRouting:
    """The routing part of :class:`~xferlib.adapters.torch.ShardedEmbeddingBagCollection`
    (a base class of it): reads its ``plan``, ``tables``, ``dim_offsets``, ``device`` and
    ``world_size``."""

    def _build_routes(self) -> None:
        """Device tensors that route a lookup: a table's global row number (``base[t] +
        row``) finds its shard, whose owner, slot in the owner's collection and first row
        make the destination and the local index."""
        plan, dev, world = self.plan, self.device, self.world_size
        rows = [c.num_rows for c in self.tables]
        base = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        slots = {s: k for r in range(world) for k, s in enumerate(plan.shards_of(r))}
        self._max_slots = max(1, max(len(plan.shards_of(r)) for r in range(world)))
        as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        self._table_rows, self._table_base = as_long(rows), as_long(base)
        self._shard_start = as_long([base[s.table_index] + s.row_start for s in plan.shards])
        self._shard_owner = as_long([s.rank for s in plan.shards])
        self._shard_slot = as_long([slots[s] for s in plan.shards])
        self._shard_first = as_long([s.row_start for s in plan.shards])
        # Per owner: its slots' rows of the count table, and its shards' output columns.
        self._owner_slots, self._owner_cols, self._owner_dim = [], [], []
        for r in range(world):
            mine = plan.shards_of(r)
            self._owner_slots.append(as_long([r * self._max_slots + k
                                              for k in range(len(mine))]))
            cols = [c for s in mine for c in range(self.dim_offsets[s.table_index],
                                                   self.dim_offsets[s.table_index + 1])]
            self._owner_cols.append(as_long(cols))
            self._owner_dim.append(len(cols))
        # Per owner: how many tables have a shard there (max_bag_size bounds its lookups).
        self._owner_tables = [plan.tables_of(r) for r in range(world)]

    def _locate(self, indices, offsets, B):
        """Each lookup's destination, on the device without a sync: ``(local index, owner,
        slot (owner * max_slots + shard's place there), sample, bad index?, bad offsets?,
        bag lengths, bag)``."""
        dev, T = self.device, len(self.tables)
        idx, off = indices.to(dev, torch.int64), offsets.to(dev, torch.int64)
        n, bags = idx.shape[0], T * B
        # Offsets as FBGEMM's contract has them (start 0, never decrease, end at n).
        bad_off = (off[0] != 0) | (off[-1] != n)
        if bags:
            bad_off = bad_off | (off[1:] < off[:-1]).any()
        # Each index's bag from the offsets, clamped so garbage offsets route harmlessly
        # (they are refused before anything is sent).
        bag = torch.searchsorted(off[1:], torch.arange(n, device=dev), right=True)
        bag = bag.clamp_(max=max(bags - 1, 0))
        table, sample = bag // max(B, 1), bag % max(B, 1)
        limit = self._table_rows[table]
        bad_each = (idx < 0) | (idx >= limit)
        row = self._table_base[table] + torch.minimum(idx.clamp(min=0), limit - 1)
        shard = torch.searchsorted(self._shard_start, row, right=True) - 1
        owner = self._shard_owner[shard]
        slot = owner * self._max_slots + self._shard_slot[shard]
        # An index out of range stays out of its shard's range (the owner refuses it).
        local = torch.where(bad_each, idx, row - self._table_base[table]) \
            - self._shard_first[shard]
        lengths = off[1:] - off[:-1] if bags else off[:0]
        return local, owner, slot, sample, bad_each, bad_off, lengths, bag

    def _route(self, indices, offsets, B):
        """Where each lookup goes, on the device without a sync: ``(send_indices sorted by
        (owner, slot), counts per (owner, slot, bag), indices per owner, bad-value code
        (0 none, 1 an index out of range, 2 bad offsets), bag lengths)``."""
        dev, world = self.device, self.world_size
        local, owner, slot, sample, bad_each, bad_off, lengths, bag = self._locate(
            indices, offsets, B)
        order = torch.sort(slot, stable=True).indices
        counts = torch.zeros(world * self._max_slots * max(B, 1), dtype=torch.int64,
                             device=dev)
        counts.index_add_(0, slot * B + sample, torch.ones_like(slot))
        per_owner = torch.zeros(world, dtype=torch.int64, device=dev)
        per_owner.index_add_(0, owner, torch.ones_like(owner))
        bad = torch.where(bad_off, 2, bad_each.any().to(torch.int64))
        return local[order], order, counts, per_owner, bad, lengths, bag
