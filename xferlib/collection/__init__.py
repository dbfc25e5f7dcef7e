"""Embedding collections: every table of a model in one object, one pooled lookup and one
fused backward + update for all of them (``collection.py``); table configs (``config.py``);
storage per placement (``storage.py``); the tt placement's TT tables (``tt_tables.py``); the
NumPy path (``numpy_path.py``), the GPU path (``device.py``) and the float64 references
(``reference.py``)."""

from xferlib.collection.collection import EmbeddingCollection, LookupContext
from xferlib.collection.config import PLACEMENTS, POOLINGS, TableConfig
from xferlib.collection.reference import (collection_step_reference,
                                          lookup_gradients_reference, pooled_lookup_reference)
from xferlib.collection.sharding import Shard, ShardingPlan, plan_sharding

__all__ = ["EmbeddingCollection", "LookupContext", "TableConfig", "PLACEMENTS", "POOLINGS",
           "pooled_lookup_reference", "lookup_gradients_reference",
           "collection_step_reference", "Shard", "ShardingPlan", "plan_sharding"]
