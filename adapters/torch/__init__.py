"""PyTorch adapter: xferlib's ops as torch autograd functions, on CPU and CUDA tensors."""

from xferlib.adapters.torch.rows import gather_rows

__all__ = ["gather_rows"]
