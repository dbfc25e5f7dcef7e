"""FBGEMM's table-batched embeddings (``fbgemm_gpu``'s ``SplitTableBatchedEmbeddingBagsCodegen``,
the engine under TorchRec) as a baseline: the same table and batches as the collection, its
optimizer fused into the backward, rows in host memory (``MANAGED``, UVM), with an LRU cache
in HBM (``MANAGED_CACHING``) or in HBM (``DEVICE``). Used only where ``fbgemm_gpu`` imports.
"""

from __future__ import annotations

import time

__all__ = ["available", "tbe_step"]

# xferlib's optimizer names -> FBGEMM's optimizer, and the hyperparameters it takes.
_OPTIMIZERS = {"sgd": "EXACT_SGD", "adam": "ADAM", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}
PLACEMENTS = {"host": "MANAGED", "cache": "MANAGED_CACHING", "hbm": "DEVICE"}


def available() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen)
    except Exception:  # not installed, or built for another torch / CUDA
        return False
    return True


def _enums():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            CacheAlgorithm, EmbeddingLocation, PoolingMode)
    except ImportError:  # older layouts kept them in the training module
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            CacheAlgorithm, EmbeddingLocation, PoolingMode)
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice
    except ImportError:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice
    return EmbOptimType, CacheAlgorithm, EmbeddingLocation, PoolingMode, ComputeDevice


def tbe_step(tables, placement: str, optimizer: str, hyper: dict, indices, offsets, grad,
             cache_fraction: float = 0.05):
    """``(step(i), build seconds)``: a TBE over ``tables`` (``(rows, dim)`` pairs) at
    ``placement`` (``"host"``, ``"cache"`` or ``"hbm"``), whose ``step(i)`` runs forward and
    backward (the fused update) on batch ``i`` of ``indices`` (torch tensors on the GPU, one
    per batch) with the shared ``offsets`` and pooled gradient ``grad``."""
    import torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen)

    EmbOptimType, CacheAlgorithm, EmbeddingLocation, PoolingMode, ComputeDevice = _enums()
    location = getattr(EmbeddingLocation, PLACEMENTS[placement])
    kwargs = dict(learning_rate=hyper.get("lr", 0.01), eps=hyper.get("eps", 1e-8),
                  weight_decay=hyper.get("weight_decay", 0.0))
    if optimizer == "adam":
        kwargs.update(beta1=hyper.get("betas", (0.9, 0.999))[0],
                      beta2=hyper.get("betas", (0.9, 0.999))[1])
    start = time.perf_counter()
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, dim, location, ComputeDevice.CUDA) for rows, dim in tables],
        optimizer=getattr(EmbOptimType, _OPTIMIZERS[optimizer]),
        pooling_mode=PoolingMode.SUM, cache_load_factor=cache_fraction,
        cache_algorithm=CacheAlgorithm.LRU, device=torch.device("cuda"), **kwargs)
    torch.cuda.synchronize()
    build = time.perf_counter() - start

    def step(i):
        out = tbe(indices[i % len(indices)], offsets)
        out.backward(grad)

    step.module = tbe
    return step, build
