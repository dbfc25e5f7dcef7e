"""Differentiable row gather for torch."""

from __future__ import annotations

import torch

from xferlib import rows as core_rows
from xferlib.adapters.torch._convert import as_core_array, current_stream


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, idx):
        out_device = idx.device if idx.is_cuda else table.device
        out = torch.empty((idx.shape[0], table.shape[1]), dtype=table.dtype, device=out_device)
        stream = current_stream(out_device)
        _, residuals = core_rows.gather_rows_fwd(
            as_core_array(table), as_core_array(idx), out=as_core_array(out), stream=stream)
        core_rows.check_rows()  # autograd users get the IndexError from this call
        ctx.save_for_backward(idx)
        ctx.table_meta = (table.shape, table.dtype, table.device)
        ctx.num_rows = residuals[1]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (idx,) = ctx.saved_tensors
        shape, dtype, device = ctx.table_meta
        grad_table = torch.empty(shape, dtype=dtype, device=device)
        grad_out = grad_out.to(device=device, dtype=dtype).contiguous()
        if device.type != "cuda":
            idx = idx.cpu()
        core_rows.gather_rows_bwd((as_core_array(idx), ctx.num_rows), as_core_array(grad_out),
                                  out=as_core_array(grad_table), stream=current_stream(device))
        core_rows.check_rows()
        return grad_table, None


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` as a differentiable op: xferlib's sorted, deduplicated gather.

    ``table``: a 2-D tensor on CPU (pinned, for a GPU gather of host rows) or CUDA. ``idx``:
    1-D int32/int64 indices; the rows land on ``idx``'s device. Backward scatter-adds the
    incoming gradient into a dense table gradient, summing repeated indices deterministically.

    >>> import torch
    >>> from xferlib.adapters.torch import gather_rows
    >>> table = torch.randn(10, 4, requires_grad=True)
    >>> gather_rows(table, torch.tensor([1, 1, 3])).sum().backward()
    >>> table.grad[1].tolist()
    [2.0, 2.0, 2.0, 2.0]
    """
    if not isinstance(table, torch.Tensor) or not isinstance(idx, torch.Tensor):
        raise TypeError("gather_rows takes torch tensors (table, idx)")
    if table.is_cuda and not idx.is_cuda:
        idx = idx.to(table.device, non_blocking=True)
    if table.dim() == 2 and table.stride(-1) != 1:
        table = table.contiguous()
    return _GatherRows.apply(table, idx)
