"""SpeedTorch's CuPy classes (its ``CUPYLive`` module): ``ModelFactory``,
``OptimizerFactory``, ``COM``, ``DataGadget``, their base ``_Common``, and the pinned CuPy
allocator ``PMemory`` / ``my_pinned_allocator``.

A collection is a CuPy array in GPU memory (``CPUPinn=False``) or an xferlib pinned host
array (``CPUPinn=True``), read through ``getCupyVar()`` / ``.CUPYcorpus`` as a CuPy array over
that pinned memory, as SpeedTorch's pinned allocator gave. Without a GPU both are NumPy arrays
in ordinary host memory and the rows are torch CPU tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from xferlib.adapters.torch.speedtorch._store import Store, as_index, default_device
from xferlib.adapters.torch.speedtorch._switch import (ModelSwitch, OptimizerSwitch,
                                                       reshaped_retrieval, where)
from xferlib.handoff import to_torch

__all__ = ["PMemory", "my_pinned_allocator", "_Common", "ModelFactory", "OptimizerFactory",
           "COM", "DataGadget"]


def _pinned_memory_class(name: str):
    """A CuPy memory class over xferlib pinned host memory (SpeedTorch's ``PMemory``), built
    on first use so that importing this module does not need CuPy."""
    import cupy

    from xferlib.memory import device_pointer, pinned_empty

    class _PinnedMemory(cupy.cuda.memory.BaseMemory):
        """``size`` bytes of pinned host memory for a CuPy allocator; freed with the object."""

        def __init__(self, size):
            self.size = int(size)
            self.device_id = cupy.cuda.device.get_device_id()
            self._host = pinned_empty((max(self.size, 1),), np.uint8)
            self.ptr = device_pointer(self._host) if self.size > 0 else 0

    _PinnedMemory.__name__ = _PinnedMemory.__qualname__ = name
    return _PinnedMemory


_LAZY = {}


def __getattr__(name):
    if name in ("PMemory", "PMemoryMM"):
        if name not in _LAZY:
            _LAZY[name] = _pinned_memory_class(name)
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def my_pinned_allocator(bsize):
    """A CuPy allocator (``cupy.cuda.set_allocator(my_pinned_allocator)``) whose arrays live in
    pinned host memory that the GPU reads directly."""
    import cupy

    return cupy.cuda.memory.MemoryPointer(__getattr__("PMemory")(bsize), 0)


class _Common:
    """Saving, loading and reading a collection (SpeedTorch's ``_Common``)."""

    _store: Store

    def getCupyVar(self):
        """The full collection: a CuPy array (over pinned host memory for ``CPUPinn=True``);
        a NumPy array on a machine without a GPU."""
        return self._store.exposed()

    @property
    def CUPYcorpus(self):
        return self._store.exposed()

    @CUPYcorpus.setter
    def CUPYcorpus(self, values):
        self._store.place(values)

    def saveCupy(self, saveFileName) -> None:
        """Save the collection as a ``.npy`` file (what ``cupy.save`` writes)."""
        np.save(saveFileName, self._store.numpy())

    def loadCupy(self, loadFileName) -> None:
        """Load a collection saved by :meth:`saveCupy` (or ``cupy.save`` / ``numpy.save``)."""
        self._store.place(np.load(loadFileName, allow_pickle=False))

    def getNumpyVersion(self) -> np.ndarray:
        """A NumPy copy of the full collection."""
        return self._store.numpy()

    def _getReshapedRetrieval(self, retrievedPosIndexes, retrievedNegIndexes=None):
        return reshaped_retrieval(retrievedPosIndexes, retrievedNegIndexes)


class ModelFactory(ModelSwitch, _Common):
    """Switcher for a model variable (an ``nn.Embedding``): rows of the full collection go
    into ``model_variable.weight`` before the forward pass and back after the step.

    ``ModelFactory(model_variable, total_classes, embed_dimension, datatype='float32',
    CPUPinn=False)``. Initializers draw from CuPy's global generator on a GPU (the numbers
    SpeedTorch draws after ``cupy.random.seed``), from NumPy's global generator without one
    (``numpy.random.seed``). Repeated indexes: see ``beforeForwardPass``'s class notes (xferlib
    sums a repeated row's gradients; SpeedTorch kept one copy's update).

    >>> import numpy as np, torch
    >>> from xferlib.adapters.torch import speedtorch as SpeedTorch
    >>> emb = torch.nn.Embedding(6, 4)
    >>> switcher = SpeedTorch.ModelFactory(emb, total_classes=100, embed_dimension=4)
    >>> switcher.zerosInit()
    >>> switcher.beforeForwardPass(np.array([[3, 7, 7], [1, 2, 99]]))
    >>> tuple(emb.weight.shape)
    (6, 4)
    """

    def __init__(self, model_variable, total_classes, embed_dimension, datatype="float32",
                 CPUPinn=False, diskname=None):
        # diskname: SpeedTorch's README lists it for ModelFactory, whose code never took it
        # (only ModelFactoryMM names a file); accepted by keyword for the README's call form,
        # and unused. Positional arguments keep the code's order (datatype fourth).
        self.datatype = datatype
        self.CPUPinn = CPUPinn
        self._dtype = np.dtype(datatype)
        self._store = Store("cupy", where(CPUPinn))
        self._setup_model(model_variable, total_classes, embed_dimension)


class OptimizerFactory(OptimizerSwitch, _Common):
    """Switcher for the optimizer state of one model variable.

    ``OptimizerFactory(given_optimizer, total_classes, embed_dimension, model, variable_name,
    dtype='float32', CPUPinn=False)``; ``optInit()`` creates the collections (``CUPYcorpi``,
    one per name in ``optVarList``); ``getCupyVar()`` and friends read the first."""

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype="float32", CPUPinn=False):
        self.datatype = dtype
        self.CPUPinn = CPUPinn
        self._dtype = np.dtype(dtype)
        self._setup_optimizer(given_optimizer, total_classes, embed_dimension, model,
                              variable_name)

    def _new_store(self) -> Store:
        return Store("cupy", where(self.CPUPinn))

    @property
    def CUPYcorpi(self):
        """One CuPy array per ``optVarList`` entry (NumPy without a GPU)."""
        return [s.exposed() for s in self._require_stores()]


class COM(_Common):
    """A (total_classes x total_classes) co-occurrence matrix: ``comInit()`` allocates it
    zeroed as ``CUPYCom``.

    ``COM(total_classes, datatype='uint32', CPUPinn=False)``."""

    def __init__(self, total_classes, datatype="uint32", CPUPinn=False):
        self.total_classes = int(total_classes)
        self.datatype = datatype
        self.CPUPinn = CPUPinn
        self._store = Store("cupy", where(CPUPinn))

    def comInit(self, CPUPinn=False) -> None:
        """Allocate the zeroed matrix (placed as the constructor's ``CPUPinn`` says, as in
        SpeedTorch, whose ``CPUPinn`` argument here is unused)."""
        self._store.empty((self.total_classes, self.total_classes), np.dtype(self.datatype))
        self._store.fill(0)

    @property
    def CUPYCom(self):
        return self._store.exposed()


class DataGadget(_Common):
    """A ``.npy`` data array whose rows are served as torch tensors (on the GPU where there
    is one): ``DataGadget(fileName, CPUPinn=False)``, then ``gadgetInit()``.

    ``getData(indexes)`` takes any index CuPy takes (an int, a slice, a boolean mask, or an
    integer array of any shape, NumPy, CuPy or torch) and keeps its shape: the result is
    ``indexes.shape + row_shape``, as ``CUPYcorpus[indexes]`` is. ``insertData(dataObject,
    indexes)`` writes rows the same way; a row named twice keeps the last write.

    >>> import numpy as np, tempfile, os
    >>> from xferlib.adapters.torch import speedtorch as SpeedTorch
    >>> path = os.path.join(tempfile.mkdtemp(), "data.npy")
    >>> np.save(path, np.arange(20, dtype=np.float32).reshape(10, 2))
    >>> gadget = SpeedTorch.DataGadget(path)
    >>> gadget.gadgetInit()
    >>> tuple(gadget.getData(np.array([[1, 2, 3], [4, 5, 6]])).shape)
    (2, 3, 2)
    """

    def __init__(self, fileName, CPUPinn=False):
        self.fileName = fileName
        self.CPUPinn = CPUPinn
        self._store = Store("cupy", where(CPUPinn))

    def gadgetInit(self) -> None:
        """Load the data file into the collection."""
        self.loadCupy(self.fileName)

    def getData(self, indexes) -> torch.Tensor:
        """The rows at ``indexes`` as a new tensor of shape ``indexes.shape + row_shape``."""
        flat, shape = as_index(indexes, self._store.num_rows, gpu=self._store.gpu)
        rows = self._store.get(flat, default_device())
        return rows.reshape(*shape, *self._store.row_shape)

    def insertData(self, dataObject, indexes) -> None:
        """``collection[indexes] = dataObject`` (a tensor or array of shape
        ``indexes.shape + row_shape``)."""
        rows = dataObject if isinstance(dataObject, torch.Tensor) else to_torch(
            np.asarray(dataObject) if not hasattr(dataObject, "__cuda_array_interface__")
            else dataObject)
        flat, shape = as_index(indexes, self._store.num_rows, gpu=self._store.gpu)
        expected = (*shape, *self._store.row_shape)
        if tuple(rows.shape) != expected and rows.numel() != int(np.prod(expected)):
            raise ValueError(f"dataObject: expected shape {expected} for these indexes, got "
                             f"{tuple(rows.shape)}")
        self._store.put(flat, rows.reshape(flat.shape[0], -1))
