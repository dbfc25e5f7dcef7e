"""``HostEmbeddingBag`` / ``HostEmbedding`` over a one-table embedding collection.

A fused optimizer, ``sum`` or ``mean`` pooling (``HostEmbedding``: bags of one lookup) and a
private table: the module is a single-table :class:`EmbeddingBagCollection` with its table in
pinned host RAM (``placement="host"``), so it runs the collection's engine: each lookup's
row pooled in registers (no row buffer per lookup), one fused backward + update, the
collection's GPU cache. Its ``table`` is :class:`CollectionTable`, the reading and writing
part of :class:`xferlib.HostTable`'s API over that table. The rest (``mode="max"``,
``optimizer=None``, a table shared by a process group, the ``"lfu"`` cache policy) runs on a
:class:`xferlib.HostTable` (``host.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from xferlib.backend import array_module
from xferlib.adapters.torch.collection import EmbeddingBagCollection
from xferlib.collection import TableConfig

__all__ = ["CollectionTable", "collection_serves", "single_table_bags", "bag_layout",
           "weights_gradient_path"]

TABLE = "table"  # the one table's name in the collection (its state keys: "table.<name>")


def collection_serves(optimizer, group, cache_policy: str, mode: str, num_rows: int) -> bool:
    """Whether a module with these options runs on the collection engine."""
    return (optimizer is not None and group is None and cache_policy == "lru"
            and mode in ("sum", "mean") and num_rows >= 1)


def single_table_bags(num_rows: int, dim: int, *, optimizer, optimizer_kwargs, cache_rows: int,
                      device: torch.device, init, mode: str, seed,
                      cuda_graphs: bool = False) -> EmbeddingBagCollection:
    """The module's collection: one host table; an array ``init`` becomes its weights."""
    given = init if isinstance(init, np.ndarray) else None
    if given is not None and (given.shape != (num_rows, dim) or given.dtype != np.float32):
        raise ValueError(f"an init array must be float32 of shape {(num_rows, dim)}, got "
                         f"{given.dtype} {given.shape}")
    cache = min(cache_rows, num_rows) if device.type == "cuda" else 0
    config = TableConfig(num_rows, dim, name=TABLE, placement="host", cache_rows=cache,
                         init="zeros" if given is not None else init)
    bags = EmbeddingBagCollection([config], optimizer, optimizer_kwargs, pooling=mode,
                                  device=device, seed=seed, cuda_graphs=cuda_graphs)
    if given is not None:
        bags.collection.write_rows(0, np.arange(num_rows), given)
    return bags


def bag_layout(indices: torch.Tensor, offsets, per_sample_weights, *, include_last_offset: bool,
               padding_idx, device: torch.device):
    """``torch.nn.EmbeddingBag``'s inputs (2-D ``indices``, or 1-D with ``offsets`` of bag
    starts) as one table's FBGEMM layout: ``(indices, B + 1 offsets, weights)`` on
    ``device``. Lookups of ``padding_idx`` are dropped (torch's rule: they add nothing and
    do not count in a mean), which reads the batch's size back (a host sync)."""
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    indices = indices.to(device)
    if indices.dim() == 2:
        rows, width = indices.shape
        offsets = torch.arange(rows + 1, device=device, dtype=indices.dtype) * width
        indices = indices.reshape(-1)
    else:
        offsets = offsets.to(device)
        if not include_last_offset:
            end = torch.full((1,), indices.shape[0], dtype=offsets.dtype, device=device)
            offsets = torch.cat([offsets, end])
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.to(device).reshape(-1)
    if padding_idx is None:
        return indices, offsets, per_sample_weights
    n = indices.shape[0]
    if offsets.numel() and bool(((offsets < 0) | (offsets > n)).any()):
        raise ValueError(f"offsets must lie within 0..{n} (the number of indices)")
    keep = indices != padding_idx
    kept_before = torch.cat([keep.new_zeros(1, dtype=offsets.dtype),
                             keep.cumsum(0).to(offsets.dtype)])
    offsets = kept_before[offsets.long()]
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights[keep]
    return indices[keep], offsets, per_sample_weights


def weights_gradient_path(bags: EmbeddingBagCollection, indices, offsets, weights):
    """A zero whose gradient in ``weights`` (per-sample weights that require grad, sum
    pooling) is torch's: each weight gets the dot product of its bag's gradient and its
    lookup's row, the row as the forward read it (the fused update changes it in the
    backward). The rows of the batch are read for it, one per lookup, and the offsets are
    checked on the host first (torch's kernel is not to see bad ones): only such weights pay
    that. Call it before the engine's forward, which it does not replace."""
    n = indices.shape[0]
    bounds = offsets.to("cpu", torch.int64)
    if (bounds.numel() < 1 or int(bounds[0]) != 0 or int(bounds[-1]) != n
            or bool((bounds[1:] < bounds[:-1]).any())):
        raise ValueError(f"offsets must start at 0, never decrease and end at the number of "
                         f"indices ({n}), got {bounds.tolist()[:8]}...")
    starts = torch.arange(n + 1, device=bags.device, dtype=torch.int64)
    rows = bags._lookup(bags._core(indices, "indices"), bags._core(starts, "offsets"), None,
                        train=False)[0]
    pooled = torch.nn.functional.embedding_bag(
        torch.arange(n, device=bags.device), rows, offsets.to(torch.int64), mode="sum",
        per_sample_weights=weights.to(rows.dtype), include_last_offset=True)
    return pooled - pooled.detach()


class CollectionTable:
    """The table of a single-table module, with :class:`xferlib.HostTable`'s reading and
    writing methods (``numpy``, ``state``, ``state_names``, ``lookup``, ``hyper``,
    ``set_hyper``, ``restore``, ``scatter``, ``flush``, ``cache_stats``, ``check``,
    ``save``) answered by the
    module's one-table :class:`xferlib.collection.EmbeddingCollection` (``collection``).
    ``save`` writes the collection's file (:meth:`EmbeddingCollection.load` reads it)."""

    cache_policy = "lru"
    shared_name = None  # a private table (a table shared by ranks is a HostTable)

    def __init__(self, bags: EmbeddingBagCollection):
        self._bags = bags

    @property
    def collection(self):
        return self._bags.collection  # the module's current one (a rebuild replaces it)

    @property
    def optimizer(self) -> str:
        return self.collection.optimizer

    @property
    def num_rows(self) -> int:
        return self.collection.tables[0].num_rows

    @property
    def dim(self) -> int:
        return self.collection.dims[0]

    @property
    def dtype(self) -> np.dtype:
        return self.collection.dtype

    @property
    def cache_rows(self) -> int:
        return self.collection.tables[0].cache_rows

    @property
    def hyper(self) -> dict:
        return dict(self.collection.hypers[0])

    def set_hyper(self, **changes) -> None:
        self.collection.set_hyper(0, **changes)

    def numpy(self) -> np.ndarray:
        """The weights, ``(num_rows, dim)`` (read-only; queued GPU work finished first)."""
        return self.collection.weights(0)

    def state(self, name: str) -> np.ndarray:
        return self.collection.state(0, name)

    def state_names(self) -> tuple:
        return self.collection.state_names()

    def restore(self, weights, state: dict, *, partial: bool = False) -> None:
        """Weights and optimizer state arrays (``partial``: some of them) written whole."""
        arrays = {f"{TABLE}.{name}": value for name, value in state.items()}
        if weights is not None:
            arrays[f"{TABLE}.weight"] = weights
        self.collection.load_state_dict(arrays, partial=partial)

    def scatter(self, idx, rows, *, stream=None) -> None:
        """Overwrite the weights of rows ``idx`` (their optimizer state kept)."""
        self.collection.write_rows(0, idx, rows)

    def lookup(self, idx, out=None, *, stream=None):
        """Rows ``idx`` (NumPy or CuPy integers) as a ``(len(idx), dim)`` array of the same
        namespace (bags of one lookup: the engine's pooled read)."""
        xp = array_module(idx)
        offsets = xp.arange(idx.shape[0] + 1, dtype=np.int64)
        return self.collection.lookup(idx, offsets, out=out, stream=stream)

    def flush(self) -> None:
        """Queued GPU work done and cached rows written back to host RAM."""
        self.collection.synchronize()

    def cache_stats(self) -> dict:
        return self.collection.cache_stats()

    def check(self) -> None:
        self._bags.check()

    def save(self, path) -> None:
        self.collection.save(path)

    def __repr__(self) -> str:
        return (f"CollectionTable({self.num_rows}, {self.dim}, optimizer={self.optimizer!r}, "
                f"cache_rows={self.cache_rows})")
