"""Host-resident embedding tables: weights and optimizer state in pinned host RAM.

``rules`` (sparse optimizer rules and their reference), ``layout`` (row layout,
initializers), ``host_table`` (:class:`HostTable`), ``device`` (GPU launches, deferred
input checks), ``cache`` (the set-associative GPU cache), ``prefetch``, ``io`` (save/load).
"""

from xferlib.table.cache import CacheModel
from xferlib.table.host_table import HostTable
from xferlib.table.rules import SPARSE_OPTIMIZERS, optimizer_defaults, sparse_update_reference

__all__ = ["HostTable", "CacheModel", "SPARSE_OPTIMIZERS", "optimizer_defaults",
           "sparse_update_reference"]
