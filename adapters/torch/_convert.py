"""torch tensors as the core's arrays (NumPy on CPU, CuPy on CUDA), without copies."""

from __future__ import annotations

import numpy as np
import torch

from xferlib.handoff import to_cupy, to_numpy
from xferlib.rows import gather_rows, scatter_rows


def as_core_array(t: torch.Tensor):
    """A zero-copy NumPy (CPU) or CuPy (CUDA) view of a detached tensor."""
    t = t.detach()
    return to_cupy(t) if t.is_cuda else to_numpy(t)


def current_stream(device: torch.device):
    """The stream torch is using on ``device`` (None for CPU): kernels launch on it."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a NumPy dtype."""
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def gather_to_torch(table, idx, device: torch.device) -> torch.Tensor:
    """``table[idx]`` (a 2-D NumPy, pinned NumPy or CuPy array) as a new tensor on ``device``,
    through xferlib's row gather on torch's stream."""
    out = torch.empty((idx.shape[0], table.shape[1]), dtype=torch_dtype(table.dtype),
                      device=device)
    gather_rows(table, idx, out=as_core_array(out), stream=current_stream(device))
    return out


def scatter_from_torch(table, idx, rows: torch.Tensor, device: torch.device) -> None:
    """``table[idx] = rows`` (last write wins), ``rows`` cast to the table's dtype."""
    rows = rows.detach().to(device=device, dtype=torch_dtype(table.dtype))
    scatter_rows(table, idx, as_core_array(rows.reshape(idx.shape[0], -1).contiguous()),
                 stream=current_stream(device))


def fresh_row_state(optimizer: torch.optim.Optimizer, param, state: dict, width: int) -> dict:
    """For each tensor of ``state`` (``optimizer``'s state of ``param``) shaped like
    ``param``, the values a row that never took a step starts from: the state of the same
    optimizer class and hyperparameters after one zero-gradient step of one zero row, which
    is its initial state for every torch.optim optimizer but SGD with dampening (whose first
    step copies the gradient). Returns name -> ``(width,)`` NumPy array."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    probe = torch.nn.Parameter(torch.zeros(1, width, dtype=param.dtype))
    probe.grad = torch.zeros_like(probe)
    hyper = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
    fresh = type(optimizer)([probe], **hyper)
    fresh.step()
    return {name: fresh.state[probe][name].detach().reshape(-1).numpy()
            for name, value in state.items()
            if isinstance(value, torch.Tensor) and value.shape == param.shape}
