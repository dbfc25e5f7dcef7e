"""xferlib: a GPU memory engine for embedding-heavy training.

The core imports NumPy only; CuPy, torch and JAX are imported lazily, where they are used.
"""

from xferlib import batch, collection, optim, tt
from xferlib._backend import cupy_available
from xferlib.atomic import atomic_write
from xferlib.collection import EmbeddingCollection, TableConfig
from xferlib.batch import BatchPlan, PendingChecks, Verdict, plan_batch
from xferlib.handoff import array_kind, data_pointer, to_cupy, to_jax, to_numpy, to_torch
from xferlib.memory import (PinnedArray, check_host_memory, is_pinned, pin, pinned_empty,
                            pinned_zeros, unpin)
from xferlib.perf import XferlibPerformanceWarning
from xferlib.table import (SPARSE_OPTIMIZERS, HostTable, optimizer_defaults,
                           sparse_update_reference)
from xferlib.tt import TTTable
from xferlib.rows import (
    check_rows,
    gather_rows,
    gather_rows_bwd,
    gather_rows_fwd,
    gather_rows_reference,
    scatter_add_rows,
    scatter_add_rows_reference,
    scatter_rows,
    scatter_rows_reference,
    unique_indices,
)

__version__ = "0.1.0"

__all__ = [
    "BatchPlan",
    "EmbeddingCollection",
    "TableConfig",
    "collection",
    "HostTable",
    "TTTable",
    "PendingChecks",
    "Verdict",
    "batch",
    "plan_batch",
    "PinnedArray",
    "SPARSE_OPTIMIZERS",
    "array_kind",
    "atomic_write",
    "check_rows",
    "cupy_available",
    "data_pointer",
    "gather_rows",
    "gather_rows_bwd",
    "gather_rows_fwd",
    "gather_rows_reference",
    "is_pinned",
    "optimizer_defaults",
    "optim",
    "pin",
    "pinned_empty",
    "pinned_zeros",
    "scatter_add_rows",
    "scatter_add_rows_reference",
    "scatter_rows",
    "scatter_rows_reference",
    "sparse_update_reference",
    "to_cupy",
    "to_jax",
    "to_numpy",
    "to_torch",
    "tt",
    "unique_indices",
    "unpin",
    "check_host_memory",
    "XferlibPerformanceWarning",
]
