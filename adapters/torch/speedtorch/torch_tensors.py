"""SpeedTorch's torch-tensor classes: ``PytorchModelFactory``, ``PytorchOptimizerFactory``,
``PytorchCOM`` (its ``GenTorch``: collection on ``deviceType``, pinned if ``pinType``),
``GPUPytorch*`` (collection on the GPU) and ``CPUPytorch*`` (collection in pinned CPU memory,
rows switched into a model on the GPU), with their bases ``_PytorchCommon``,
``_GPUPytorchCommon`` and ``_CPUPytorchCommon``.

The collection is a torch tensor (``pytorchGPUVar``, or ``pytorchCPUVar`` for the CPU
classes); rows move with xferlib's row kernels (zero-copy from pinned memory) instead of
torch indexing. Initializers are ``torch.nn.init``'s, as in SpeedTorch: reproducible after
``torch.manual_seed``. Where SpeedTorch was broken and these are not: ``getTorchVar()``
returns the collection (SpeedTorch's read an attribute it never set), ``comInit()`` works
(SpeedTorch's read attributes ``*COM`` classes do not have), and the CPU classes'
``getNumpyVersion()`` returns a NumPy array (SpeedTorch's returned the tensor).
"""

from __future__ import annotations

import numpy as np
import torch

from xferlib.adapters.torch.speedtorch._store import Store, as_torch_dtype, gpu_available
from xferlib.adapters.torch.speedtorch._switch import (ModelSwitch, OptimizerSwitch,
                                                       reshaped_retrieval)

__all__ = ["_PytorchCommon", "PytorchModelFactory", "PytorchOptimizerFactory", "PytorchCOM",
           "_GPUPytorchCommon", "GPUPytorchModelFactory", "GPUPytorchOptimizerFactory",
           "GPUPytorchCOM", "_CPUPytorchCommon", "CPUPytorchModelFactory",
           "CPUPytorchOptimizerFactory", "CPUPytorchCOM"]


def _place(deviceType, pinType, cpu_form="pass deviceType='cpu'") -> str:
    """``cpu_form``: what to write instead on a machine without a GPU (the ``GPUPytorch*``
    classes take no ``deviceType``)."""
    device = torch.device(deviceType)
    if device.type == "cuda":
        if not gpu_available():
            raise RuntimeError(f"deviceType={deviceType!r} needs a CUDA GPU (with CuPy); none "
                               f"is available here: {cpu_form}")
        return "gpu"
    if device.type != "cpu":
        raise ValueError(f"deviceType must be 'cuda' or 'cpu', got {deviceType!r}")
    return "pinned" if pinType and gpu_available() else "host"


class _PytorchCommon:
    """Saving, loading and reading a torch collection (SpeedTorch's ``_PytorchCommon``)."""

    _store: Store
    _var_name = "pytorchGPUVar"

    def getTorchVar(self):
        """The full collection tensor (a list of them for an optimizer switcher)."""
        return getattr(self, self._var_name)

    def saveTorch(self, saveFileName) -> None:
        """``torch.save`` of the collection."""
        torch.save(getattr(self, self._var_name), saveFileName)

    def loadTorch(self, loadFileName) -> None:
        """Load a tensor saved by :meth:`saveTorch` as the collection (placed where this
        switcher keeps its collection)."""
        self._store.place(torch.load(loadFileName, map_location="cpu"))

    def getNumpyVersion(self) -> np.ndarray:
        return self._store.numpy()

    def _getReshapedRetrieval(self, retrievedPosIndexes, retrievedNegIndexes=None):
        return reshaped_retrieval(retrievedPosIndexes, retrievedNegIndexes)


class _ModelBase(ModelSwitch, _PytorchCommon):
    def _start(self, model_variable, total_classes, embed_dimension, datatype, place):
        self.dtype = as_torch_dtype(datatype)
        self._dtype = self.dtype
        self._store = Store("torch", place)
        self._setup_model(model_variable, total_classes, embed_dimension)

    def customInit(self, initFunction, *args) -> None:
        """The collection allocated, then ``initFunction(collection, *args)`` (any
        ``torch.nn.init`` function)."""
        self._store.empty((self.total_classes, self.embed_dimension), self.dtype)
        initFunction(self._store.array, *args)

    def _tensor(self):
        return self._store.array

    def _set_tensor(self, value):
        self._store.place(value, dtype=self.dtype)


class _OptimizerBase(OptimizerSwitch, _PytorchCommon):
    def _start(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
               dtype, place):
        self.dtype = as_torch_dtype(dtype)
        self._dtype = self.dtype
        self._place = place
        self._setup_optimizer(given_optimizer, total_classes, embed_dimension, model,
                              variable_name)

    def _new_store(self) -> Store:
        return Store("torch", self._place)

    def _tensor(self):
        return [s.array for s in self._require_stores()]

    def _set_tensor(self, value):
        for store, tensor in zip(self._require_stores(), value):
            store.place(tensor, dtype=self.dtype)


class _COMBase(_PytorchCommon):
    def _start(self, total_classes, datatype, place):
        self.total_classes = int(total_classes)
        self.dtype = as_torch_dtype(datatype)
        self._store = Store("torch", place)

    def comInit(self) -> None:
        """Allocate the zeroed (total_classes x total_classes) matrix."""
        self._store.empty((self.total_classes, self.total_classes), self.dtype)
        self._store.fill(0)

    def _tensor(self):
        return self._store.array

    def _set_tensor(self, value):
        self._store.place(value, dtype=self.dtype)


def _collection_attribute(name):
    return property(lambda self: self._tensor(), lambda self, value: self._set_tensor(value),
                    doc=f"The collection tensor, SpeedTorch's ``{name}``.")


# ----------------------------------------------------------------------------- GenTorch


class PytorchModelFactory(_ModelBase):
    """``PytorchModelFactory(model_variable, total_classes, embed_dimension,
    datatype=torch.float, deviceType='cuda', pinType=False)``: a model switcher whose
    collection is a torch tensor on ``deviceType`` (pinned when ``pinType`` and on the CPU);
    rows land on the model variable's device."""

    pytorchGPUVar = _collection_attribute("pytorchGPUVar")

    def __init__(self, model_variable, total_classes, embed_dimension, datatype=torch.float,
                 deviceType="cuda", pinType=False):
        self.deviceType, self.pinType = deviceType, pinType
        place = _place(deviceType, pinType)
        self._start(model_variable, total_classes, embed_dimension, datatype, place)


class PytorchOptimizerFactory(_OptimizerBase):
    """``PytorchOptimizerFactory(given_optimizer, total_classes, embed_dimension, model,
    variable_name, dtype=torch.float, deviceType='cuda', pinType=False)``."""

    pytorchGPUVar = _collection_attribute("pytorchGPUVar")

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype=torch.float, deviceType="cuda", pinType=False):
        self.deviceType, self.pinType = deviceType, pinType
        self._start(given_optimizer, total_classes, embed_dimension, model, variable_name,
                    dtype, _place(deviceType, pinType))


class PytorchCOM(_COMBase):
    """``PytorchCOM(total_classes, datatype=torch.int32)``: a zeroed square matrix after
    ``comInit()``, on the GPU where there is one (``deviceType`` / ``pinType`` choose, as
    for the factories)."""

    pytorchGPUVar = _collection_attribute("pytorchGPUVar")

    def __init__(self, total_classes, datatype=torch.int32, deviceType=None, pinType=False):
        deviceType = deviceType or ("cuda" if gpu_available() else "cpu")
        self.deviceType, self.pinType = deviceType, pinType
        self._start(total_classes, datatype, _place(deviceType, pinType))


# ----------------------------------------------------------------------------- GPUTorch

_GPU_ONLY = ("the GPUPytorch* classes keep their collection on the GPU; use CPUPytorch* or "
             "Pytorch*(..., deviceType='cpu') instead")


class _GPUPytorchCommon(_PytorchCommon):
    """SpeedTorch's ``_GPUPytorchCommon``: the collection on the GPU."""


class GPUPytorchModelFactory(_ModelBase, _GPUPytorchCommon):
    """``GPUPytorchModelFactory(model_variable, total_classes, embed_dimension,
    datatype=torch.float)``: ``PytorchModelFactory`` on ``'cuda'``."""

    pytorchGPUVar = _collection_attribute("pytorchGPUVar")

    def __init__(self, model_variable, total_classes, embed_dimension, datatype=torch.float):
        self._start(model_variable, total_classes, embed_dimension, datatype,
                    _place("cuda", False, _GPU_ONLY))


class GPUPytorchOptimizerFactory(_OptimizerBase, _GPUPytorchCommon):
    """``GPUPytorchOptimizerFactory(given_optimizer, total_classes, embed_dimension, model,
    variable_name, dtype=torch.float)``."""

    pytorchGPUVar = _collection_attribute("pytorchGPUVar")

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype=torch.float):
        self._start(given_optimizer, total_classes, embed_dimension, model, variable_name,
                    dtype, _place("cuda", False, _GPU_ONLY))


class GPUPytorchCOM(_COMBase, _GPUPytorchCommon):
    """``GPUPytorchCOM(total_classes, datatype=torch.int32)``."""

    pytorchGPUVar = _collection_attribute("pytorchGPUVar")

    def __init__(self, total_classes, datatype=torch.int32):
        self._start(total_classes, datatype, _place("cuda", False, _GPU_ONLY))


# ----------------------------------------------------------------------------- CPUTorchPinned


class _CPUPytorchCommon(_PytorchCommon):
    """SpeedTorch's ``_CPUPytorchCommon``: the collection in pinned CPU memory
    (``pytorchCPUVar``); ordinary CPU memory on a machine without a GPU."""

    _var_name = "pytorchCPUVar"


class CPUPytorchModelFactory(_ModelBase, _CPUPytorchCommon):
    """``CPUPytorchModelFactory(model_variable, total_classes, embed_dimension,
    datatype=torch.float)``: rows switched from pinned CPU memory into the model variable
    (zero-copy when it is on the GPU)."""

    pytorchCPUVar = _collection_attribute("pytorchCPUVar")

    def __init__(self, model_variable, total_classes, embed_dimension, datatype=torch.float):
        self._start(model_variable, total_classes, embed_dimension, datatype,
                    _place("cpu", True))


class CPUPytorchOptimizerFactory(_OptimizerBase, _CPUPytorchCommon):
    """``CPUPytorchOptimizerFactory(given_optimizer, total_classes, embed_dimension, model,
    variable_name, dtype=torch.float)``."""

    pytorchCPUVar = _collection_attribute("pytorchCPUVar")

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype=torch.float):
        self._start(given_optimizer, total_classes, embed_dimension, model, variable_name,
                    dtype, _place("cpu", True))


class CPUPytorchCOM(_COMBase, _CPUPytorchCommon):
    """``CPUPytorchCOM(total_classes, datatype=torch.int32)``."""

    pytorchCPUVar = _collection_attribute("pytorchCPUVar")

    def __init__(self, total_classes, datatype=torch.int32):
        self._start(total_classes, datatype, _place("cpu", True))
