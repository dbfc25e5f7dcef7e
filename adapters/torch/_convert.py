"""torch tensors as the core's arrays (NumPy on CPU, CuPy on CUDA), without copies."""

from __future__ import annotations

import contextlib
import inspect
import sys

import numpy as np
import torch

from xferlib.backend import as_cupy_stream
from xferlib.handoff import to_cupy, to_numpy
from xferlib.rows import gather_rows, scatter_rows


def as_core_array(t: torch.Tensor):
    """A zero-copy NumPy (CPU) or CuPy (CUDA) view of a detached tensor."""
    t = t.detach()
    return cuda_view(t) if t.is_cuda else to_numpy(t)


_CUPY_VIEW_DTYPES = {torch.float32: np.float32, torch.float64: np.float64,
                     torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
                     torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
                     torch.bool: np.bool_}


def cuda_view(t: torch.Tensor):
    """A CuPy array over a CUDA tensor's memory (kept alive by the view), built from its
    pointer, shape and strides: a few microseconds, where a DLPack exchange costs tens (it
    queries devices and streams on both sides). The caller orders work on torch's stream.
    Other dtypes (bfloat16) go through DLPack."""
    dtype = _CUPY_VIEW_DTYPES.get(t.dtype)
    if dtype is None:
        return to_cupy(t)
    import cupy

    numel = t.numel()
    if numel == 0:
        return cupy.empty(tuple(t.shape), dtype=dtype)
    itemsize = t.element_size()
    if t.is_contiguous():  # the common case: CuPy's default strides, no extent to compute
        memory = cupy.cuda.UnownedMemory(t.data_ptr(), numel * itemsize, t, t.get_device())
        return cupy.ndarray(tuple(t.shape), dtype=dtype,
                            memptr=cupy.cuda.MemoryPointer(memory, 0))
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), extent * itemsize, t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0),
                        strides=tuple(s * itemsize for s in t.stride()))


def current_stream(device: torch.device):
    """The stream torch is using on ``device`` (None for CPU): kernels launch on it."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def cupy_stream(device: torch.device):
    """torch's current stream on CUDA ``device`` as a CuPy stream (one wrapper per raw
    handle): one query of the raw handle, where ``torch.cuda.current_stream`` builds a new
    Python stream object at every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = (_RAW_STREAM(index) if _RAW_STREAM is not None
              else torch.cuda.current_stream(device).cuda_stream)
    return as_cupy_stream(handle)


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


def probe_row_state(optimizer: torch.optim.Optimizer, param, width: int) -> dict:
    """The per-element state ``optimizer`` keeps for one ``(1, width)`` row of ``param`` and
    the values a row that never took a step starts from: the state of the same optimizer class
    and hyperparameters after one zero-gradient step of one zero row, which is its initial
    state for every torch.optim optimizer but SGD with dampening (whose first step copies the
    gradient). Returns name -> ``(width,)`` NumPy array; raises ValueError for optimizers that
    cannot be stepped row by row (LBFGS needs a closure; Adafactor's factored moments span
    rows)."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    probe = torch.nn.Parameter(torch.zeros(1, width, dtype=param.dtype))
    accepted = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    # Group keys the constructor does not take (AdamW's decoupled_weight_decay on torch >= 2.8,
    # a scheduler's initial_lr) are left out.
    hyper = {k: v for k, v in group.items()
             if k != "params" and (k in accepted or (takes_any and k != "initial_lr"))}
    fresh = _stepped_once(type(optimizer), hyper, probe)
    # Two rows tell state kept per row from state that spans rows (Adafactor's col_var is
    # (1, width) for any number of rows, which one row cannot tell apart).
    pair = torch.nn.Parameter(torch.zeros(2, width, dtype=param.dtype))
    spanning = [name for name, value in _stepped_once(type(optimizer), hyper,
                                                      pair).state[pair].items()
                if isinstance(value, torch.Tensor) and value.dim() > 0
                and value.shape != pair.shape]
    if spanning:
        raise ValueError(f"{type(optimizer).__name__} keeps state that is not one row per "
                         f"embedding row ({', '.join(spanning)}): it cannot be stepped row by "
                         f"row")
    return {name: value.detach().reshape(-1).numpy()
            for name, value in fresh.state[probe].items()
            if isinstance(value, torch.Tensor) and value.shape == probe.shape}


def _stepped_once(cls, hyper: dict, probe) -> torch.optim.Optimizer:
    """A new ``cls`` optimizer of ``probe`` (zero rows) after one zero-gradient step."""
    probe.grad = torch.zeros_like(probe)
    fresh = cls([probe], **hyper)
    try:
        fresh.step()
    except RuntimeError:  # SparseAdam takes sparse gradients only
        probe.grad = torch.zeros_like(probe).to_sparse()
        try:
            fresh.step()
        except Exception as err:
            raise ValueError(f"{cls.__name__} cannot be stepped row by row ({err})") from err
    except TypeError as err:  # LBFGS and others that need a closure
        raise ValueError(f"{cls.__name__} cannot be stepped row by row ({err})") from err
    return fresh


def fresh_row_state(optimizer: torch.optim.Optimizer, param, state: dict, width: int) -> dict:
    """``probe_row_state`` for the tensors of ``state`` (``optimizer``'s state of ``param``)
    shaped like ``param``."""
    fresh = probe_row_state(optimizer, param, width)
    # row-shaped: any number of rows (Adagrad makes its state in __init__, for no rows yet)
    return {name: fresh[name] for name, value in state.items()
            if isinstance(value, torch.Tensor) and value.dim() == param.dim()
            and value.shape[1:] == param.shape[1:] and name in fresh}


def array_of(t: torch.Tensor):
    """A zero-copy NumPy (CPU) or CuPy (CUDA) view of a tensor."""
    if t.is_cuda and not t.requires_grad:  # the step's path: no detach, no device object
        return cuda_view(t)
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"TT embedding bags run on CPU or CUDA tensors, got {t.device}")
    return as_core_array(t)


def on_stream(t: torch.Tensor, capturing=None, stream=None):
    """torch's current stream as a context for CuPy work (nothing on the CPU). While torch
    captures a CUDA graph, CuPy also allocates from torch's caching allocator, so the step's
    scratch memory comes from the graph's pool and stays reserved for its replays.
    ``stream``: torch's current stream as a CuPy stream, where the caller has it."""
    if t.device.type != "cuda":
        return contextlib.nullcontext()
    scope = cupy_stream(t.device) if stream is None else stream
    if not (stream_capturing() if capturing is None else capturing):
        return scope
    import cupy

    stack = contextlib.ExitStack()
    stack.enter_context(scope)
    stack.enter_context(cupy.cuda.using_allocator(_torch_allocator().malloc))
    return stack


def stream_capturing() -> bool:
    """Whether torch's current stream is capturing a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_ALLOCATOR = []


def _torch_allocator():
    """A CuPy allocator over torch's caching allocator (on torch's current stream)."""
    if not _ALLOCATOR:
        import cupy

        alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
        current_stream, finalizing = torch.cuda.current_stream, sys.is_finalizing

        def malloc(size, device):
            return alloc(max(int(size), 1), device, current_stream(device))

        def free(pointer, device):
            # bound above: at interpreter exit CuPy frees its last blocks after this module's
            # globals are gone; the process's memory goes with it then
            if not finalizing():
                delete(pointer)

        _ALLOCATOR.append(cupy.cuda.memory.PythonFunctionAllocator(malloc, free))
    return _ALLOCATOR[0]
