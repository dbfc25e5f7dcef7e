"""Drop-in shims for SpeedTorch's switchers: ``ModelFactory``, ``OptimizerFactory``,
``DataGadget``, with SpeedTorch's names, arguments and call order, so a SpeedTorch training
script runs by changing its import::

    from xferlib.adapters.torch import speedtorch as SpeedTorch

What changes underneath (the meaning of every call stays):

* It works on torch 2.x with every optimizer. The optimizer's per-row state is found by
  parameter, not by position in ``optimizer.state_dict()`` (which SpeedTorch relies on and
  which no longer holds), and is created from the optimizer's own initial state.
* No update is lost on repeated indices. When a batch names a row at several positions, the
  gradients of those positions are summed (a hook on the model variable's gradient) and every
  copy takes the same step from the same state, so the row receives exactly the update of a
  dense step on its summed gradient, with any elementwise optimizer; for SGD that is a dense
  SGD step on the summed gradient. SpeedTorch keeps one arbitrary copy's update.
* Rows move with xferlib's sorted, deduplicated zero-copy kernels on the caller's stream,
  with no device-wide synchronization; without a GPU everything runs on the CPU.

``CPUPinn=True`` keeps the full collection in pinned host memory; ``False`` (SpeedTorch's
default) keeps it in GPU memory when there is a GPU. Either way the collection is a 2-D array
(CuPy or NumPy) returned by ``getCupyVar()``.
"""

from __future__ import annotations

import numpy as np
import torch

from xferlib._backend import cupy_available
from xferlib.adapters.torch._convert import fresh_row_state, gather_to_torch, scatter_from_torch
from xferlib.handoff import to_torch
from xferlib.memory import pinned_empty

__all__ = ["ModelFactory", "OptimizerFactory", "DataGadget"]


def _retrieval(pos, neg=None) -> np.ndarray:
    """SpeedTorch's order: every positive index, then every negative one, flattened."""
    parts = [pos] if neg is None else [pos, neg]
    arrays = [p.detach().cpu().numpy() if isinstance(p, torch.Tensor) else np.asarray(p)
              for p in parts]
    idx = np.concatenate([a.reshape(-1) for a in arrays])
    if idx.dtype.kind not in "iu":
        raise TypeError(f"indexes must be integers, got {idx.dtype}")
    return idx.astype(np.int64, copy=False)


class _Collection:
    """A (rows x dim) collection: CuPy on the GPU (CPUPinn=False), pinned NumPy
    (CPUPinn=True), or NumPy without a GPU; rows go to and from torch tensors on ``device``."""

    def __init__(self, cpu_pinned: bool, device: torch.device):
        self.cpu_pinned = cpu_pinned
        self.device = device
        self.array = None
        self.row_shape = ()

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def place(self, host: np.ndarray) -> None:
        if host.ndim < 1:
            raise ValueError("a collection needs at least one axis (its rows)")
        self.row_shape = host.shape[1:]
        host = host.reshape(host.shape[0], -1)
        if not self.gpu:
            self.array = np.ascontiguousarray(host)
        elif self.cpu_pinned:
            self.array = pinned_empty(host.shape, host.dtype)
            self.array[...] = host
        else:
            import cupy

            self.array = cupy.asarray(host)

    def require(self, what: str):
        if self.array is None:
            raise RuntimeError(f"{what} needs an initialized collection: call an init method "
                               f"(zerosInit, uniformDistributionInit, ...) first")
        return self.array

    def indices(self, idx: np.ndarray):
        if self.gpu:
            import cupy

            return cupy.asarray(idx)
        return idx

    def get(self, idx: np.ndarray) -> torch.Tensor:
        rows = gather_to_torch(self.require("reading rows"), self.indices(idx), self.device)
        return rows.view(idx.size, *self.row_shape)

    def put(self, idx: np.ndarray, rows: torch.Tensor) -> None:
        scatter_from_torch(self.require("writing rows"), self.indices(idx), rows, self.device)

    def numpy(self) -> np.ndarray:
        array = self.require("reading the collection")
        if self.gpu:
            torch.cuda.current_stream(self.device).synchronize()
        host = array.get() if hasattr(array, "get") else np.array(array)
        return host.reshape(host.shape[0], *self.row_shape)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and cupy_available() else "cpu")


class _Common:
    def getCupyVar(self):
        """The full collection (a CuPy array on the GPU, else NumPy)."""
        return self._collection.require("getCupyVar")

    def getNumpyVersion(self) -> np.ndarray:
        """A NumPy copy of the full collection."""
        return self._collection.numpy()

    def saveCupy(self, saveFileName) -> None:
        """Save the collection as a ``.npy`` file (``numpy.save``; CuPy's save writes the same)."""
        np.save(saveFileName, self._collection.numpy())

    def loadCupy(self, loadFileName) -> None:
        """Load a collection saved by :meth:`saveCupy` (or ``cupy.save``/``numpy.save``)."""
        self._collection.place(np.load(loadFileName, allow_pickle=False))


class ModelFactory(_Common):
    """SpeedTorch's switcher for a model variable (an ``nn.Embedding`` or any module with a
    ``weight``): rows of the full collection are switched into ``model_variable.weight``
    before the forward pass and back after the optimizer step."""

    def __init__(self, model_variable, total_classes, embed_dimension, datatype="float32",
                 CPUPinn=False):
        if not isinstance(getattr(model_variable, "weight", None), torch.Tensor):
            raise TypeError("model_variable must be a module with a `weight` parameter, such "
                            "as the model's nn.Embedding")
        self.model_variable = model_variable
        self.total_classes, self.embed_dimension = int(total_classes), int(embed_dimension)
        self.datatype = np.dtype(datatype)
        self.CPUPinn = CPUPinn
        device = model_variable.weight.device
        if device.type == "cuda" and not cupy_available():
            raise ValueError("a CUDA model variable needs CuPy (xferlib[cuda12] or [cuda13])")
        self._collection = _Collection(CPUPinn, device)
        self._groups = None  # each switched-in position's row among the batch's unique rows
        self._num_unique = 0
        model_variable.weight.register_hook(self._sum_repeated_rows)

    def _init(self, fill) -> None:
        host = np.empty((self.total_classes, self.embed_dimension), dtype=self.datatype)
        fill(host)
        self._collection.place(host)

    def zerosInit(self) -> None:
        self._init(lambda a: a.fill(0))

    def uniformDistributionInit(self, low, high) -> None:
        rng = np.random.default_rng()
        self._init(lambda a: a.__setitem__(..., rng.uniform(low, high, a.shape)))

    def normalDistributionInit(self, mean, stdDev) -> None:
        rng = np.random.default_rng()
        self._init(lambda a: a.__setitem__(..., rng.normal(mean, stdDev, a.shape)))

    def variableTransformer(self, batchSize, posPerBatch, negPerBatch=None):
        """The dummy inputs the model's forward pass uses: positions into the switched-in
        rows (positives first, then negatives)."""
        pos = np.arange(batchSize * posPerBatch).reshape(batchSize, posPerBatch)
        if negPerBatch is None:
            return pos
        start = batchSize * posPerBatch
        neg = np.arange(start, start + batchSize * negPerBatch).reshape(batchSize, negPerBatch)
        return pos, neg

    def beforeForwardPass(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        idx = _retrieval(retrievedPosIndexes, retrievedNegIndexes)
        rows = self._collection.get(idx)
        unique, groups = np.unique(idx, return_inverse=True)
        self._num_unique = unique.size
        self._groups = torch.from_numpy(groups.reshape(-1)).to(rows.device)
        with torch.no_grad():
            self.model_variable.weight.data = rows

    def afterOptimizerStep(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        idx = _retrieval(retrievedPosIndexes, retrievedNegIndexes)
        # Every copy of a repeated row took the same step, so any copy is the row's update.
        self._collection.put(idx, self.model_variable.weight.data)
        self._groups = None

    def _sum_repeated_rows(self, grad: torch.Tensor) -> torch.Tensor:
        groups = self._groups
        if groups is None or grad.shape[0] != groups.shape[0]:
            return grad
        sparse = grad.is_sparse
        dense = grad.to_dense() if sparse else grad
        summed = dense.new_zeros((self._num_unique, *dense.shape[1:]))
        summed.index_add_(0, groups, dense)
        out = summed.index_select(0, groups)
        return out.to_sparse() if sparse else out


class OptimizerFactory(_Common):
    """SpeedTorch's switcher for an optimizer's per-row state of one model variable.

    Every state tensor the optimizer keeps with the variable's shape (``exp_avg``, ``sum``,
    ``square_avg``, ...) gets a full collection, created on the first
    :meth:`afterOptimizerStep` from the optimizer's own state for a fresh row."""

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype="float32", CPUPinn=False):
        self.given_optimizer = given_optimizer
        self.total_classes, self.embed_dimension = int(total_classes), int(embed_dimension)
        self.model, self.variable_name = model, variable_name
        self.datatype = np.dtype(dtype)
        self.CPUPinn = CPUPinn
        params = dict(model.named_parameters())
        name = variable_name if variable_name in params else f"{variable_name}.weight"
        if name not in params:
            raise ValueError(f"the model has no parameter {variable_name!r} (or "
                             f"{variable_name}.weight); it has {sorted(params)}")
        self.param = params[name]
        if not any(p is self.param for g in given_optimizer.param_groups for p in g["params"]):
            raise ValueError(f"{name} is not among given_optimizer's parameters")
        self._collections = None
        self._collection = None  # getCupyVar and friends: the first state's collection

    def optInit(self) -> None:
        """Prepare the state collections (filled on the first step, when torch creates the
        optimizer's state)."""
        self._collections = {}

    def _require_init(self) -> dict:
        if self._collections is None:
            raise RuntimeError("call optInit() before switching optimizer state")
        return self._collections

    def beforeForwardPass(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        collections = self._require_init()
        state = self.given_optimizer.state.get(self.param)
        if not collections or not state:
            return
        idx = _retrieval(retrievedPosIndexes, retrievedNegIndexes)
        for name, collection in collections.items():
            state[name] = collection.get(idx)

    def afterOptimizerStep(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        collections = self._require_init()
        state = self.given_optimizer.state.get(self.param, {})
        if not collections:
            self._create_collections(state)
        idx = _retrieval(retrievedPosIndexes, retrievedNegIndexes)
        for name, collection in collections.items():
            collection.put(idx, state[name])

    def _create_collections(self, state) -> None:
        fresh = fresh_row_state(self.given_optimizer, self.param, state, self.embed_dimension)
        for name, values in fresh.items():
            host = np.empty((self.total_classes, self.embed_dimension), self.datatype)
            host[...] = values
            collection = _Collection(self.CPUPinn, self.param.device)
            collection.place(host)
            self._collections[name] = collection
            if self._collection is None:
                self._collection = collection


class DataGadget(_Common):
    """SpeedTorch's data holder: a ``.npy`` array whose rows are served as torch tensors."""

    def __init__(self, fileName, CPUPinn=False):
        self.fileName = fileName
        self.CPUPinn = CPUPinn
        self._collection = _Collection(CPUPinn, _default_device())

    def gadgetInit(self) -> None:
        self.loadCupy(self.fileName)

    def getData(self, retrievedPosIndexes, retrievedNegIndexes=None) -> torch.Tensor:
        return self._collection.get(_retrieval(retrievedPosIndexes, retrievedNegIndexes))

    def insertData(self, dataObject, indexes) -> None:
        """Write rows ``dataObject`` (a tensor or array) at ``indexes`` (last write wins)."""
        rows = dataObject if isinstance(dataObject, torch.Tensor) else to_torch(dataObject)
        self._collection.put(_retrieval(indexes), rows)
