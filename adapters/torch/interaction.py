"""DLRM's dot interaction for torch: :mod:`xferlib.interaction`'s two kernels as an autograd
function and a module."""

from __future__ import annotations

import torch

from xferlib import interaction as core
from xferlib.adapters.torch._convert import as_core_array, cupy_stream


class _DotInteraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pooled):
        B, T, d = pooled.shape
        out = torch.empty((B, core.interaction_width(T, d)), dtype=x.dtype, device=x.device)
        stream = cupy_stream(x.device) if x.is_cuda else None
        core.dot_interaction_fwd(as_core_array(x), as_core_array(pooled),
                                 out=as_core_array(out), stream=stream)
        ctx.save_for_backward(x, pooled)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, pooled = ctx.saved_tensors
        dx, dpooled = torch.empty_like(x), torch.empty_like(pooled)
        stream = cupy_stream(x.device) if x.is_cuda else None
        core.dot_interaction_bwd((as_core_array(x), as_core_array(pooled)),
                                 as_core_array(grad.contiguous()), dx=as_core_array(dx),
                                 dpooled=as_core_array(dpooled), stream=stream)
        return dx, dpooled


def dot_interaction(x: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """DLRM's interaction of the dense vector ``x`` (B, d) with the pooled rows ``pooled``
    (B, T, d): ``(B, d + n (n - 1) / 2)``, ``x`` then the dot product of every pair ``i < j``
    of the ``n = T + 1`` vectors (``numpy.triu_indices`` order), what the top MLP takes.
    Differentiable in both inputs; on CUDA one kernel forward and one backward (capturable
    in a CUDA graph; shapes past the kernels' shared memory, see
    :func:`xferlib.interaction.fits_gpu_kernels`, run torch's ``bmm`` instead), on the CPU
    NumPy. Equal to

    >>> import torch
    >>> x, pooled = torch.randn(4, 8), torch.randn(4, 3, 8)
    >>> v = torch.cat([x[:, None], pooled], dim=1)
    >>> i, j = torch.triu_indices(4, 4, 1)
    >>> plain = torch.cat([x, (v @ v.transpose(1, 2))[:, i, j]], dim=1)
    >>> torch.allclose(dot_interaction(x, pooled), plain, atol=1e-5)
    True
    """
    if not isinstance(x, torch.Tensor) or not isinstance(pooled, torch.Tensor):
        raise TypeError("dot_interaction takes torch tensors (x, pooled)")
    if x.device != pooled.device:
        raise ValueError(f"dot_interaction: x is on {x.device} and pooled on {pooled.device}")
    core.check_shapes(x.shape, pooled.shape)  # the core checks the rest, in its own terms
    B, T, d = pooled.shape
    if x.is_cuda and not core.fits_gpu_kernels(T, d, _numpy_dtype(x.dtype)):
        return _plain(x, pooled)  # too wide for the kernels' shared memory: torch's ops
    return _DotInteraction.apply(x.contiguous(), pooled.contiguous())


def _numpy_dtype(dtype):
    return {torch.float32: "float32", torch.float64: "float64"}.get(dtype, "float32")


def _plain(x, pooled):
    """The interaction in torch ops (cat, bmm, the upper triangle): the same values, for
    shapes the kernels do not take."""
    v = torch.cat([x[:, None], pooled], dim=1)
    i, j = torch.triu_indices(v.shape[1], v.shape[1], 1, device=x.device)
    return torch.cat([x, torch.bmm(v, v.transpose(1, 2))[:, i, j]], dim=1)


class DotInteraction(torch.nn.Module):
    """:func:`dot_interaction` as a module (no parameters): ``forward(x, pooled)``."""

    def forward(self, x: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return dot_interaction(x, pooled)
