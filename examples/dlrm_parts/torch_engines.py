"""The DLRM's embedding engines in PyTorch (``torch_run.DLRM`` picks one): the xferlib
collection (sharded under torchrun), the plain-torch baseline, and FBGEMM's TBE. Each gives
``forward(cat) -> (B, tables, dim)`` pooled rows from the batch's ``(tables, B, pooling)``
indices, and all start from the same initial rows (``init.collection_rows``)."""

from __future__ import annotations

import numpy as np
import torch

import xferlib
from xferlib.adapters.torch import (EmbeddingBagCollection, OptimType,
                                    ShardedEmbeddingBagCollection, TTEmbeddingBag)

from . import init as initial
from .sharding import table_configs


class XferlibEmbeddings(torch.nn.Module):
    """Every collection table in one ``EmbeddingBagCollection`` (FBGEMM's input layout: the
    batch's ``cat`` of shape (tables, B, pooling) IS the flat ``indices``, table after table,
    bag after bag), TT tables as ``TTEmbeddingBag`` modules. ``forward(cat)`` gives
    ``(B, tables, dim)`` in table order."""

    def __init__(self, preset, plan, seed, device, optimizer, sharding=None):
        super().__init__()
        lr, dim = preset.lr_embedding, preset.dim
        self.coll_tables = [t.index for t in plan.tables if t.where != "tt"]
        self.tt_tables = [t.index for t in plan.tables if t.where == "tt"]
        configs = table_configs(preset, plan, device.type)
        self.sharded = sharding is not None
        if self.sharded:  # this rank's shards only; lookups routed to their owners
            if self.tt_tables:
                raise ValueError("the sharded collection holds no TT tables")
            # capturable on GPUs: fixed-size messages, no host read in a step, so the whole
            # step (its all_to_alls included) is captured in one CUDA graph; every bag holds
            # `pooling` lookups, so each owner's room is its tables' lookups, no padding
            capturable = device.type == "cuda"
            self.collection = ShardedEmbeddingBagCollection(
                configs, optimizer, {"lr": lr}, plan=sharding, device=device, seed=seed,
                capturable=capturable, max_bag_size=preset.pooling if capturable else None)
        else:
            self.collection = EmbeddingBagCollection(configs, optimizer, {"lr": lr},
                                                     device=device, seed=seed)
        self.tt = torch.nn.ModuleList()
        for t in plan.tables:
            if t.where != "tt":
                continue
            module = TTEmbeddingBag(t.rows, dim, list(t.tt_ranks), list(t.tt_p), list(t.tt_q),
                                    optimizer=OptimType.EXACT_ADAGRAD, learning_rate=lr,
                                    sparse=True, mode="sum", include_last_offset=True)
            with torch.no_grad():
                for param, value in zip(module.tt_cores, initial.tt_cores(t, seed)):
                    param.copy_(xferlib.to_torch(value)[None])
            self.tt.append(module.to(device))
        self._offsets = {}
        self.num_tables, self.dim = len(plan.tables), dim

    def offsets(self, tables, B, L, device):
        key = (tables, B, L)
        if key not in self._offsets:  # made once per shape: a captured step reuses it
            self._offsets[key] = torch.arange(0, tables * B * L + 1, L, device=device)
        return self._offsets[key]

    def forward(self, cat):
        T, B, L = cat.shape
        if not self.tt_tables:  # the common case: no copy, cat is the flat indices
            pooled = self.collection(cat.reshape(-1), self.offsets(T, B, L, cat.device))
            return pooled.view(B, T, self.dim)
        coll = cat[self.coll_tables]
        pooled = self.collection(coll.reshape(-1),
                                 self.offsets(len(self.coll_tables), B, L, cat.device))
        vectors = dict(zip(self.coll_tables, pooled.view(B, -1, self.dim).unbind(1)))
        per_bag = self.offsets(1, B, L, cat.device)
        for f, module in zip(self.tt_tables, self.tt):
            vectors[f] = module(cat[f].reshape(-1), per_bag)
        return torch.stack([vectors[f] for f in range(self.num_tables)], dim=1)

    def core(self):
        """The core collection of this process's tables (a rank's shards when sharded;
        None for a rank that holds none)."""
        if self.sharded:
            local = self.collection.local
            return None if local is None else local.collection
        return self.collection.collection

    def check(self):
        """Raise a deferred input error of the last lookups (an index out of range)."""
        self.collection.check()  # sharded: this rank's refusals and its shards' checks

    def cache_hit_rate(self):
        """Cache hits over the distinct host-table rows the batches looked up (xferlib's
        ``cache_stats``; this rank's shards when sharded)."""
        core = self.core()
        stats = core.cache_stats() if core is not None else {}
        return stats["hits"] / stats["lookups"] if stats.get("lookups") else None


class TorchEmbeddings(torch.nn.Module):
    """The baseline: one ``nn.EmbeddingBag(sparse=True)`` per table in HBM."""

    def __init__(self, preset, plan, seed, device):
        super().__init__()
        xp = _array_module(device)
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag.from_pretrained(
                xferlib.to_torch(initial.collection_rows(preset, seed, k, t.rows, xp)),
                freeze=False, mode="sum", sparse=True)
            for k, t in enumerate(plan.tables))

    def forward(self, cat):
        _, B, L = cat.shape
        return torch.stack([bag(cat[f]) for f, bag in enumerate(self.bags)], dim=1)


# FBGEMM's row-wise Adagrad epsilon: xferlib's default for the rule, so the pair of runs
# trains with the same hyperparameters.
ROWWISE_EPS = 1e-8


class FbgemmEmbeddings(torch.nn.Module):
    """FBGEMM's TBE over every table: ``DEVICE`` for the plan's HBM tables,
    ``MANAGED_CACHING`` (LRU, the plan's cache size) for its host tables, exact row-wise
    Adagrad fused into the backward (the configuration adapters/bench/fbgemm.py measures)."""

    def __init__(self, preset, plan, seed, device):
        super().__init__()
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen)

        from xferlib.adapters.bench.fbgemm import _enums

        EmbOptimType, CacheAlgorithm, EmbeddingLocation, PoolingMode, ComputeDevice = _enums()
        host = [t for t in plan.tables if t.where != "hbm"]
        cache_rows = sum(t.cache_rows for t in host)
        load = cache_rows / max(1, sum(t.rows for t in host))
        specs = [(t.rows, preset.dim, EmbeddingLocation.DEVICE if t.where == "hbm"
                  else EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)
                 for t in plan.tables]
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=preset.lr_embedding, eps=ROWWISE_EPS, pooling_mode=PoolingMode.SUM,
            cache_load_factor=max(load, 1e-6), cache_algorithm=CacheAlgorithm.LRU,
            device=device)
        xp = _array_module(device)
        with torch.no_grad():
            for k, (t, w) in enumerate(zip(plan.tables, self.tbe.split_embedding_weights())):
                w.copy_(xferlib.to_torch(initial.collection_rows(preset, seed, k, t.rows, xp)))
        if xp is not np:  # the rows were made by CuPy: its pool need not count them
            torch.cuda.current_stream().synchronize()
            xp.get_default_memory_pool().free_all_blocks()
        self._offsets, self.dim = {}, preset.dim

    def forward(self, cat):
        T, B, L = cat.shape
        key = (T, B, L)
        if key not in self._offsets:
            self._offsets[key] = torch.arange(0, T * B * L + 1, L, device=cat.device)
        return self.tbe(cat.reshape(-1), self._offsets[key]).view(B, T, self.dim)


def _array_module(device):
    if device.type == "cuda":
        import cupy

        return cupy
    return np
