"""Tensor-Train (TT) embedding tables: shapes, initializers, lookups, gradients, fused updates
and the row cache.

A table of ``prod(p_shapes)`` rows of ``prod(q_shapes)`` columns is stored as ``d`` cores
(2 <= d <= 4). Core ``k`` has shape ``(p_k, R_k * q_k * R_{k+1})``: row ``i_k`` of it is an
``R_k x q_k x R_{k+1}`` slice, in that order, with ``R_0 = R_d = 1`` (FBTT-Embedding's layout,
without its leading table axis). Row ``i`` of the table splits into digits
``(i_1, ..., i_d)``, most significant first (``i = sum_k i_k * prod(p_{k+1:})``), and is the
product of the slices ``G_1[i_1] G_2[i_2] ... G_d[i_d]``, flattened with ``q_1`` most
significant. Only the requested rows are ever rebuilt.

Every op has a float64 reference and a vectorized array path, which runs on NumPy arrays (CPU)
and on CuPy arrays (GPU, batched products through cuBLAS), following the arrays it is given;
GPU batches of a shape the kernels take run the CUDA kernels instead. The framework adapters
build on it. Modules: ``shape`` (:class:`TTShape`, balanced factorizations, argument checks),
``initializers`` (random cores, TT-SVD of a dense table), ``lookup`` (references, the array
path, the forward), ``plan`` (the kernel path's batch plan and its input check), ``grads``
(core gradients), ``rules`` (sparse optimizer rules on the array path), ``update`` (fused
updates), ``cache`` (:class:`TTRowCache`), ``table`` (:class:`TTTable`: cores, optimizer
state, step counter, cache, checks and scratch of a trained table, the twin of
``xferlib.HostTable``), ``table_init`` (a table's hyperparameter defaults and checks, the first
draw of its cores).
"""

from xferlib.tt.cache import NO_ROW, TTRowCache, tt_cache_grad
from xferlib.tt.grads import tt_core_grads, tt_embedding_bag_bwd
from xferlib.tt.initializers import init_tt_cores, tt_from_dense
from xferlib.tt.lookup import (tt_bag_residuals, tt_embedding_bag, tt_embedding_bag_fwd,
                               tt_embedding_bag_reference, tt_rows, tt_rows_reference,
                               tt_to_dense)
from xferlib.tt.plan import TTBagPlan, TTReport
from xferlib.tt.rules import SPARSE_OPTIMIZERS, tt_sparse_state, tt_sparse_update
from xferlib.tt.shape import TTShape, suggest_tt_shapes
from xferlib.tt.table import TTResiduals, TTTable
from xferlib.tt.update import tt_apply_core_grads, tt_cache_apply, tt_fused_update

__all__ = [
    "TTShape",
    "suggest_tt_shapes",
    "init_tt_cores",
    "tt_rows",
    "tt_rows_reference",
    "tt_to_dense",
    "tt_from_dense",
    "tt_embedding_bag",
    "tt_embedding_bag_reference",
    "tt_embedding_bag_fwd",
    "tt_embedding_bag_bwd",
    "tt_bag_residuals",
    "tt_sparse_state",
    "tt_sparse_update",
    "tt_fused_update",
    "tt_core_grads",
    "tt_apply_core_grads",
    "tt_cache_apply",
    "TTBagPlan",
    "TTReport",
    "TTRowCache",
    "tt_cache_grad",
    "NO_ROW",
    "SPARSE_OPTIMIZERS",
    "TTTable",
    "TTResiduals",
]
