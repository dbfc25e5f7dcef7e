"""A sharded collection's input, before its exchange: either form (FBGEMM's layout or the
per-table dict) as FBGEMM's layout, and the checks that read no values (the host knows the
dtypes and shapes: no sync).

``ShardedEmbeddingBagCollection`` keeps what these raise for its step, where every rank
learns of it: a rank that raised alone would leave the others waiting in the exchange.
"""

from __future__ import annotations

import torch

from xferlib.adapters.torch._convert import as_core_array, cupy_stream
from xferlib.collection.config import feature_entries, pack_features

__all__ = ["batch_size", "layout_inputs"]


def layout_inputs(names, device, indices, offsets, per_sample_weights):
    """``(indices, offsets, per_sample_weights)`` in FBGEMM's layout from either form (the
    dict form's tables in ``names``' order, moved to ``device``)."""
    if isinstance(indices, dict):
        if offsets is not None or per_sample_weights is not None:
            raise ValueError("the dict form {name: (indices, offsets[, weights])} carries "
                             "each table's offsets and weights: pass nothing else")
        return _pack(names, device, indices)
    if offsets is None:
        raise ValueError("offsets are needed with flat indices (FBGEMM's layout: "
                         "T * B + 1 bag boundaries)")
    if per_sample_weights is not None:
        if not isinstance(per_sample_weights, torch.Tensor):
            raise TypeError(f"per_sample_weights must be a torch tensor, got "
                            f"{type(per_sample_weights).__name__}")
        if per_sample_weights.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("the collection computes no gradient for "
                                      "per_sample_weights; pass per_sample_weights.detach()")
    return indices, offsets, per_sample_weights


def _pack(names, device, features: dict):
    """FBGEMM's layout from the per-table dict form, by the core's
    :func:`~xferlib.collection.config.pack_features` on views of the tensors moved to
    ``device`` (its checks too: a table's bad offsets raise at once on the host, and on a GPU
    make the packed offsets start at -1, refused in the step with no host read)."""
    parts = feature_entries(names, features)
    for name, part in zip(names, parts):
        if not all(isinstance(t, torch.Tensor) for t in part):
            raise TypeError(f"table {name!r}: the dict form takes torch tensors")
    # contiguous: the CUDA kernels read dense arrays, and CuPy's views need them
    views = {name: tuple(as_core_array(t.to(device).contiguous()) for t in part)
             for name, part in zip(names, parts)}
    if device.type != "cuda":
        return tuple(None if a is None else torch.from_numpy(a)
                     for a in _triple(pack_features(names, views)))
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index), cupy_stream(device):  # on torch's stream there
        packed = pack_features(names, views)
    return tuple(None if a is None else torch.from_dlpack(a) for a in _triple(packed))


def _triple(packed):
    return packed if len(packed) == 3 else (*packed, None)


def batch_size(num_tables: int, indices, offsets, per_sample_weights) -> int:
    """``B_local`` of a batch in FBGEMM's layout, after its dtypes and shapes are checked."""
    for name, t in (("indices", indices), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if offsets.shape[0] < 1 or (offsets.shape[0] - 1) % num_tables:
        raise ValueError(f"offsets must have T * B + 1 entries for T = {num_tables} tables, "
                         f"got {offsets.shape[0]}")
    if per_sample_weights is not None:
        if not isinstance(per_sample_weights, torch.Tensor) \
                or not per_sample_weights.is_floating_point():
            raise TypeError("per_sample_weights must be a floating point tensor")
        if per_sample_weights.shape != indices.shape:
            raise ValueError(f"per_sample_weights must have shape {tuple(indices.shape)} "
                             f"(one per index), got {tuple(per_sample_weights.shape)}")
    return (offsets.shape[0] - 1) // num_tables
