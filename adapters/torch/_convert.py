"""torch tensors as the core's arrays (NumPy on CPU, CuPy on CUDA), without copies."""

from __future__ import annotations

import torch

from xferlib.handoff import to_cupy, to_numpy


def as_core_array(t: torch.Tensor):
    """A zero-copy NumPy (CPU) or CuPy (CUDA) view of a detached tensor."""
    t = t.detach()
    return to_cupy(t) if t.is_cuda else to_numpy(t)


def current_stream(device: torch.device):
    """The stream torch is using on ``device`` (None for CPU): kernels launch on it."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None
