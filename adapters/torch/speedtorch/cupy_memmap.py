"""SpeedTorch's "memmap" CuPy classes (its ``CPUCupyPinned`` module): ``ModelFactoryMM``,
``OptimizerFactoryMM``, ``COMMM``, ``DataGadgetMM``, their base ``_CommonMM``, and
``PMemoryMM`` / ``my_pinned_allocatorMM``.

As in SpeedTorch, an init method first writes a zero ``.npy`` file named after ``diskname``
(``{diskname}{n}.memmap.cpy.npy``, ``n`` the first unused number; ``fileName`` is its stem)
and the collection is loaded from it into GPU or pinned memory (``cupy.load`` copies, so
SpeedTorch's "memmaps" were in memory too; so are these). The collection is read as
``.CUPYmemmap`` / ``getCupyMM()``.

Where SpeedTorch's module could not run, these do: ``COMMM``'s file naming and
``DataGadgetMM``'s constructor and ``getData`` raised NameErrors there.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from xferlib.adapters.torch.speedtorch import cupy_live
from xferlib.adapters.torch.speedtorch._store import Store, as_index, default_device
from xferlib.adapters.torch.speedtorch._switch import (ModelSwitch, OptimizerSwitch,
                                                       reshaped_retrieval, where)

__all__ = ["PMemoryMM", "my_pinned_allocatorMM", "_CommonMM", "ModelFactoryMM",
           "OptimizerFactoryMM", "COMMM", "DataGadgetMM"]


def __getattr__(name):
    if name == "PMemoryMM":
        return cupy_live.__getattr__("PMemoryMM")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def my_pinned_allocatorMM(bsize):
    """SpeedTorch's second pinned CuPy allocator (the same as ``my_pinned_allocator``)."""
    return cupy_live.my_pinned_allocator(bsize)


def _free_stem(prefix: str, suffix: str = "") -> str:
    """SpeedTorch's ``fileName``: ``{prefix}{n}.memmap`` for the first ``n`` whose
    ``{stem}{suffix}.cpy.npy`` does not exist."""
    n = 0
    while os.path.isfile(f"{prefix}{n}.memmap{suffix}.cpy.npy"):
        n += 1
    return f"{prefix}{n}.memmap"


def _write_zeros(path: str, shape, dtype) -> None:
    zeros = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    zeros.flush()  # a sparse file: the zeros cost no disk writes
    del zeros


def _zero_file(prefix: str, shape, dtype) -> str:
    """Write a zero ``{stem}.cpy.npy`` at the first free stem; returns the stem."""
    stem = _free_stem(prefix)
    _write_zeros(stem + ".cpy.npy", shape, dtype)
    return stem


class _CommonMM:
    """Saving and reading an MM collection (SpeedTorch's ``_CommonMM``)."""

    _store: Store

    def getCupyMM(self):
        """The full collection (CuPy; NumPy on a machine without a GPU)."""
        return self._store.exposed()

    @property
    def CUPYmemmap(self):
        return self._store.exposed()

    def saveCupy(self, saveFileName) -> None:
        np.save(saveFileName, self._store.numpy())

    def getNumpyVersion(self) -> np.ndarray:
        return self._store.numpy()

    def _getReshapedRetrieval(self, retrievedPosIndexes, retrievedNegIndexes=None):
        return reshaped_retrieval(retrievedPosIndexes, retrievedNegIndexes)

    def _preInit(self) -> None:
        """Write the zero file and remember its stem in ``fileName``."""
        self.fileName = _zero_file(self.diskname, (self.total_classes, self.embed_dimension),
                                   np.float32)

    def _load_file(self, store: Store, path: str, dtype) -> None:
        store.place(np.load(path, mmap_mode="r"), dtype=dtype)


class ModelFactoryMM(ModelSwitch, _CommonMM):
    """``ModelFactory`` whose collection starts from a zero file on disk:
    ``ModelFactoryMM(model_variable, total_classes, embed_dimension, diskname='variable',
    datatype='float32', CPUPinn=False)``."""

    def __init__(self, model_variable, total_classes, embed_dimension, diskname="variable",
                 datatype="float32", CPUPinn=False):
        self.diskname = diskname
        self.datatype = datatype
        self.CPUPinn = CPUPinn
        self._dtype = np.dtype(datatype)
        self._store = Store("cupy", where(CPUPinn))
        self._setup_model(model_variable, total_classes, embed_dimension)

    def _init_values(self, kind, a=0.0, b=0.0, dtype=None) -> None:
        self._preInit()
        self._load_file(self._store, self.fileName + ".cpy.npy", self._dtype)
        if kind != "zeros":
            self._store.draw(kind, a, b)


class OptimizerFactoryMM(OptimizerSwitch, _CommonMM):
    """``OptimizerFactory`` with one zero file per state name:
    ``OptimizerFactoryMM(given_optimizer, total_classes, embed_dimension, model,
    variable_name, dtype='float32', CPUPinn=False)``; the files are named after the variable
    and the optimizer (``diskname``, as SpeedTorch names them)."""

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype="float32", CPUPinn=False):
        self.dtype = dtype
        self.CPUPinn = CPUPinn
        self._dtype = np.dtype(dtype)
        self._setup_optimizer(given_optimizer, total_classes, embed_dimension, model,
                              variable_name)
        self.diskname = f"{variable_name}{type(given_optimizer).__name__}"

    def _new_store(self) -> Store:
        return Store("cupy", where(self.CPUPinn))

    def optInit(self) -> None:
        """Write one zero file per state name, load them, and fill each row with the
        optimizer's initial state."""
        shape = (self.total_classes, self.embed_dimension)
        first = self.optVarList[0] if self.optVarList else ""
        self.fileName = _free_stem(self.diskname, first)
        for name in self.optVarList:
            _write_zeros(self.fileName + name + ".cpy.npy", shape, np.float32)
        super().optInit()

    @property
    def CUPYmemmap(self):
        """One array per ``optVarList`` entry, as SpeedTorch's list."""
        return [s.exposed() for s in self._require_stores()]


class COMMM(_CommonMM):
    """``COMMM(total_classes, diskname='COM', datatype='uint32', CPUPinn=False)``; ``comInit()``
    writes a zero (total_classes x total_classes) file and loads it as ``CUPYmemmap``."""

    def __init__(self, total_classes, diskname="COM", datatype="uint32", CPUPinn=False):
        self.total_classes = int(total_classes)
        self.datatype = datatype
        self.diskname = diskname
        self.CPUPinn = CPUPinn
        self._store = Store("cupy", where(CPUPinn))

    def comInit(self, CPUPinn=False) -> None:
        shape = (self.total_classes, self.total_classes)
        self.fileName = _zero_file(self.diskname, shape, np.dtype(self.datatype))
        self._load_file(self._store, self.fileName + ".cpy.npy", np.dtype(self.datatype))


class DataGadgetMM(_CommonMM):
    """``DataGadgetMM(fileName, CPUPinn=False)``: a ``.npy`` file opened as a memory map and
    loaded by ``gadgetInit()``; ``getData(retrievedPosIndexes, retrievedNegIndexes=None)``
    returns the rows of the positives then the negatives, flattened (SpeedTorch's call form
    for this class)."""

    def __init__(self, fileName, CPUPinn=False):
        self.fileName = fileName
        self.CPUPinn = CPUPinn
        self._store = Store("cupy", where(CPUPinn))

    def gadgetInit(self) -> None:
        self._load_file(self._store, self.fileName, None)

    def getData(self, retrievedPosIndexes, retrievedNegIndexes=None) -> torch.Tensor:
        idx = reshaped_retrieval(retrievedPosIndexes, retrievedNegIndexes)
        flat, _ = as_index(idx, self._store.num_rows, gpu=self._store.gpu)
        return self._store.get(flat, default_device())
