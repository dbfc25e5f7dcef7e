"""SpeedTorch collections: a full table whose rows move to and from torch tensors through
xferlib's row kernels (sorted, deduplicated, zero-copy from pinned host memory).

A collection keeps its array in one of three places, chosen as SpeedTorch chose them:

=========  =========================================  ========================================
where      CuPy families (``ModelFactory``, ``*MM``)  torch families (``Pytorch*``)
=========  =========================================  ========================================
``gpu``    CuPy array in GPU memory                   CUDA tensor
``pinned`` xferlib pinned NumPy array, shown to the   pinned CPU tensor
           user as a CuPy array over the same memory
``host``   NumPy array (machines without a GPU)       CPU tensor
=========  =========================================  ========================================
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from xferlib.backend import cupy_available
from xferlib.adapters.torch._convert import (as_core_array, cuda_view, gather_to_torch,
                                             scatter_from_torch, torch_dtype)
from xferlib.handoff import to_cupy
from xferlib.memory import pinned_empty

# Initial values are drawn this many elements at a time where they land in host memory, so a
# table larger than GPU memory (the reason to pin it) never needs a device-sized temporary.
_DRAW_CHUNK = 1 << 24


def gpu_available() -> bool:
    """A CUDA GPU that both torch and CuPy see (xferlib's GPU path needs CuPy)."""
    return torch.cuda.is_available() and cupy_available()


def default_device() -> torch.device:
    return torch.device("cuda" if gpu_available() else "cpu")


def as_torch_dtype(dtype) -> torch.dtype:
    """``torch.float`` or ``'float32'`` (SpeedTorch's README writes both) as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return torch_dtype(np.dtype(dtype))


def as_index(indexes, num_rows: int, *, gpu: bool):
    """Any index CuPy accepts for rows (an int, a slice, a boolean mask, a list or a NumPy /
    CuPy / torch integer array of any shape) as ``(flat, shape)``: ``flat`` the 1-D int32/int64
    row numbers (CuPy when ``gpu``, else NumPy), negatives counted from the end as CuPy does,
    and ``shape`` the shape the result keeps in front of the row shape."""
    if isinstance(indexes, slice):
        idx = np.arange(*indexes.indices(num_rows))
    elif isinstance(indexes, numbers.Integral) and not isinstance(indexes, bool):
        idx = np.asarray(int(indexes))
    elif isinstance(indexes, torch.Tensor):
        t = indexes.detach()
        idx = cuda_view(t.contiguous()) if t.is_cuda else t.cpu().numpy()
    elif hasattr(indexes, "__cuda_array_interface__"):
        idx = indexes
    else:
        idx = np.asarray(indexes)
        if idx.dtype == object:
            raise TypeError(f"indexes must be integers, got {indexes!r}")
    on_gpu = hasattr(idx, "__cuda_array_interface__")
    xp = _cupy() if on_gpu else np
    if idx.dtype == np.bool_:
        if idx.ndim != 1 or idx.shape[0] != num_rows:
            raise IndexError(f"indexes: a boolean mask must have one entry per row "
                             f"({num_rows}), got shape {tuple(idx.shape)}")
        idx = xp.nonzero(idx)[0]
    if idx.dtype.kind not in "iu":
        raise TypeError(f"indexes must be integers, got dtype {idx.dtype}")
    shape = tuple(idx.shape)
    flat = idx.reshape(-1)
    if flat.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        flat = flat.astype(np.int64)
    if flat.dtype.kind == "i":
        if not on_gpu:
            low = flat < -num_rows
            if low.any():
                pos = int(np.argmax(low))
                raise IndexError(f"indexes: position {pos} holds {int(flat[pos])}, outside "
                                 f"[-{num_rows}, {num_rows})")
            if (flat < 0).any():
                flat = np.where(flat < 0, flat + num_rows, flat)
        else:  # CuPy wraps negatives; a value below -num_rows stays negative and is refused
            flat = xp.where(flat < 0, flat + num_rows, flat)
    if not on_gpu:  # host indices are checked here, at the call (GPU ones by the kernels)
        high = flat >= num_rows
        if high.any():
            pos = int(np.argmax(high))
            raise IndexError(f"indexes: position {pos} holds {int(flat[pos])}, outside "
                             f"[-{num_rows}, {num_rows})")
    if gpu and not on_gpu:
        flat = _cupy().asarray(flat)
    elif on_gpu and not gpu:
        flat = flat.get()
    return flat, shape


def _cupy():
    import cupy

    return cupy


class Store:
    """One collection: ``framework`` is ``"cupy"`` or ``"torch"``, ``where`` is ``"gpu"``,
    ``"pinned"`` or ``"host"`` (see the module table)."""

    def __init__(self, framework: str, where: str):
        self.framework = framework
        self.where = where
        self.array = None  # NumPy, CuPy or torch, any ndim >= 1
        self._exposed = None

    # ------------------------------------------------------------------ placement

    @property
    def gpu(self) -> bool:
        return self.where != "host"

    @property
    def device(self) -> torch.device:
        """Where rows land by default: the GPU where there is one."""
        return torch.device("cuda") if self.gpu else torch.device("cpu")

    def empty(self, shape, dtype) -> None:
        shape = tuple(int(s) for s in shape)
        if len(shape) < 1:
            raise ValueError("a collection needs at least one axis (its rows)")
        if self.framework == "torch":
            dtype = as_torch_dtype(dtype)
            device = "cuda" if self.where == "gpu" else "cpu"
            self.array = torch.empty(shape, dtype=dtype, device=device,
                                     pin_memory=self.where == "pinned")
        elif self.where == "gpu":
            self.array = _cupy().empty(shape, dtype=np.dtype(dtype))
        elif self.where == "pinned":
            self.array = pinned_empty(shape, np.dtype(dtype))
        else:
            self.array = np.empty(shape, dtype=np.dtype(dtype))
        self._exposed = None

    def place(self, values, dtype=None) -> None:
        """Copy ``values`` (NumPy, CuPy or torch) in as the whole collection."""
        if isinstance(values, torch.Tensor):
            values = values.detach()
            values = values.cpu().numpy() if self.framework == "cupy" else values
        elif hasattr(values, "__cuda_array_interface__") and self.framework == "cupy":
            values = values if self.where == "gpu" else values.get()
        elif hasattr(values, "__cuda_array_interface__"):
            values = torch.as_tensor(values, device="cuda")
        else:
            values = np.asarray(values)
            values = torch.from_numpy(np.ascontiguousarray(values)) \
                if self.framework == "torch" else values
        self.empty(values.shape, dtype if dtype is not None else values.dtype)
        if self.framework == "torch":
            self.array.copy_(values)
        elif self.where == "gpu":
            self.array[...] = _cupy().asarray(values)
        else:
            self.array[...] = values

    def require(self, what: str):
        if self.array is None:
            raise RuntimeError(f"{what} needs an initialized collection: call an init method "
                               f"(zerosInit, uniformDistributionInit, optInit, gadgetInit, ...) "
                               f"first")
        return self.array

    @property
    def num_rows(self) -> int:
        return self.require("indexing rows").shape[0]

    @property
    def row_shape(self) -> tuple:
        return tuple(self.require("indexing rows").shape[1:])

    def exposed(self):
        """What SpeedTorch's attributes show: for CuPy collections a CuPy array (a view of the
        pinned host memory for ``pinned``), NumPy without a GPU; for torch the tensor."""
        array = self.require("reading the collection")
        if self.framework == "cupy" and self.where == "pinned":
            if self._exposed is None:
                self._exposed = to_cupy(array, copy=False)
            return self._exposed
        return array

    def _table(self):
        """The collection as a 2-D NumPy or CuPy array over its memory (for the row ops)."""
        array = self.require("moving rows")
        if isinstance(array, torch.Tensor):
            return as_core_array(array.reshape(array.shape[0], -1))
        return array.reshape(array.shape[0], -1)

    # ------------------------------------------------------------------ initial values

    def fill(self, value) -> None:
        """Every row set to ``value`` (a scalar or a row-shaped vector)."""
        array = self.require("filling")
        if self.framework == "torch":
            array.copy_(torch.as_tensor(np.asarray(value)).to(array.dtype).expand_as(array))
        elif self.where == "gpu":
            array[...] = _cupy().asarray(value)
        else:
            array[...] = value

    def draw(self, kind: str, a: float, b: float) -> None:
        """Uniform on [a, b) (``kind="uniform"``) or normal (mean a, std b): torch's generator
        for torch collections (``torch.nn.init``, as SpeedTorch), CuPy's global generator on
        a GPU (``cupy.random``, as SpeedTorch), NumPy's global generator without one."""
        array = self.require("drawing")
        if self.framework == "torch":
            (torch.nn.init.uniform_(array, a=a, b=b) if kind == "uniform"
             else torch.nn.init.normal_(array, mean=a, std=b))
            return
        if self.where == "gpu":
            array[...] = _draw(_cupy().random, kind, a, b, array.shape, array.dtype)
            return
        # Host memory: chunk by chunk, from CuPy's generator where there is a GPU.
        source = _cupy().random if self.gpu else np.random
        flat = array.reshape(-1)
        for start in range(0, flat.size, _DRAW_CHUNK):
            stop = min(flat.size, start + _DRAW_CHUNK)
            chunk = _draw(source, kind, a, b, (stop - start,), flat.dtype)
            flat[start:stop] = chunk.get() if hasattr(chunk, "get") else chunk

    # ------------------------------------------------------------------ rows

    def get(self, flat, device: torch.device) -> torch.Tensor:
        """``collection[flat]`` as a new tensor on ``device``, shaped ``(n, *row_shape)``."""
        table = self._table()
        on_gpu_table = hasattr(table, "__cuda_array_interface__")
        if device.type == "cuda" or not on_gpu_table:
            flat = _for(flat, device.type == "cuda")
            rows = gather_to_torch(table, flat, device)
        else:  # a GPU collection read into a CPU tensor
            rows = gather_to_torch(table, _for(flat, True), torch.device("cuda")).cpu()
        return rows.view(rows.shape[0], *self.row_shape)

    def put(self, flat, rows: torch.Tensor) -> None:
        """``collection[flat] = rows`` (last write wins on a repeated row)."""
        table = self._table()
        rows = rows.detach()
        on_gpu_table = hasattr(table, "__cuda_array_interface__")
        device = rows.device if (rows.is_cuda or not on_gpu_table) else torch.device("cuda")
        scatter_from_torch(table, _for(flat, device.type == "cuda"),
                           rows.reshape(rows.shape[0], -1), device)

    def numpy(self) -> np.ndarray:
        """A NumPy copy of the collection, after the GPU work that writes it."""
        array = self.require("reading the collection")
        if self.gpu:
            torch.cuda.current_stream().synchronize()
            _cupy().cuda.get_current_stream().synchronize()
        if isinstance(array, torch.Tensor):
            return array.detach().cpu().numpy().copy()
        return array.get() if hasattr(array, "get") else np.array(array)


def _for(flat, gpu: bool):
    if gpu and not hasattr(flat, "__cuda_array_interface__"):
        return _cupy().asarray(flat)
    if not gpu and hasattr(flat, "__cuda_array_interface__"):
        return flat.get()
    return flat


def _draw(source, kind, a, b, shape, dtype):
    dtype = np.dtype(dtype)
    if source is np.random:
        draw = np.random.uniform if kind == "uniform" else np.random.normal
        values = draw(a, b, shape)
        return values.astype(dtype, copy=False)
    if kind == "uniform":
        return source.uniform(low=a, high=b, size=shape, dtype=dtype)
    return source.normal(loc=a, scale=b, size=shape, dtype=dtype)
