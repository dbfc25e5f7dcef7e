"""PyTorch adapter: xferlib's ops as torch autograd functions, on CPU and CUDA tensors."""

from xferlib.adapters.torch.contiguous import ContiguousParams
from xferlib.adapters.torch.optim import (
    FlatAdagrad,
    FlatAdam,
    FlatAdamax,
    FlatAdamW,
    FlatLion,
    FlatNAdam,
    FlatRAdam,
    FlatRMSprop,
    FlatSGD,
)
from xferlib.adapters.torch.rows import gather_rows

__all__ = ["ContiguousParams", "FlatAdagrad", "FlatAdam", "FlatAdamax", "FlatAdamW", "FlatLion", "FlatNAdam",
           "FlatRAdam", "FlatRMSprop", "FlatSGD", "gather_rows"]
