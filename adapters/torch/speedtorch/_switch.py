"""What every SpeedTorch family shares: switching rows of a model variable and of its
optimizer state in and out of a collection, and the dummy inputs."""

from __future__ import annotations

import numpy as np
import torch

from xferlib.adapters.torch._convert import probe_row_state
from xferlib.adapters.torch.speedtorch._store import Store, as_index, gpu_available


def where(cpu_pinned: bool, on_gpu: bool = True) -> str:
    """The Store place for a collection: pinned or GPU memory where there is a GPU, ordinary
    host memory where there is none (pinning needs a GPU)."""
    if not gpu_available():
        return "host"
    return "pinned" if cpu_pinned else ("gpu" if on_gpu else "host")


def reshaped_retrieval(pos, neg=None) -> np.ndarray:
    """SpeedTorch's order: every positive index, then every negative one, flattened."""
    parts = [pos] if neg is None else [pos, neg]
    arrays = []
    for p in parts:
        if isinstance(p, torch.Tensor):
            p = p.detach().cpu().numpy()
        elif hasattr(p, "__cuda_array_interface__"):
            p = p.get()
        arrays.append(np.asarray(p).reshape(-1))
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]


def variable_transformer(batchSize, posPerBatch, negPerBatch=None):
    """Dummy inputs for the forward pass: positions ``0..`` into the switched-in rows,
    ``(batchSize, posPerBatch)``, and the negatives' positions after them."""
    pos = np.arange(batchSize * posPerBatch).reshape(batchSize, posPerBatch)
    if negPerBatch is None:
        return pos
    start = batchSize * posPerBatch
    neg = np.arange(start, start + batchSize * negPerBatch).reshape(batchSize, negPerBatch)
    return pos, neg


class ModelSwitch:
    """Rows of a collection switched into ``model_variable.weight`` before the forward pass
    and written back after the optimizer step.

    Repeated indexes: the gradients of a row's copies are summed (one hook on the weight's
    gradient) so every copy takes the same step from the same state, and the row receives
    exactly a dense step on its summed gradient, with any elementwise optimizer. SpeedTorch
    writes the copies back in arbitrary order and keeps one copy's update (a bug: the others'
    gradient is lost)."""

    _store: Store

    def _setup_model(self, model_variable, total_classes, embed_dimension) -> None:
        weight = getattr(model_variable, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"model_variable must be a module with a `weight` parameter (the "
                            f"model's nn.Embedding), got {type(model_variable).__name__}")
        self.model_variable = model_variable
        self.total_classes = int(total_classes)
        self.embed_dimension = int(embed_dimension)
        self._groups = None  # each switched-in position's row among the batch's unique rows
        self._num_unique = 0
        weight.register_hook(self._sum_repeated_rows)

    @property
    def _device(self) -> torch.device:
        """Where switched-in rows land: the model variable's device (SpeedTorch put them on
        the GPU, which only works with a model on the GPU, where this is the same)."""
        return self.model_variable.weight.device

    def _retrieval(self, pos, neg):
        idx = reshaped_retrieval(pos, neg)
        return as_index(idx, self._store.num_rows, gpu=self._device.type == "cuda")[0]

    def _init_values(self, kind, a=0.0, b=0.0, dtype=None) -> None:
        self._store.empty((self.total_classes, self.embed_dimension),
                          self._dtype if dtype is None else dtype)
        if kind == "zeros":
            self._store.fill(0)
        else:
            self._store.draw(kind, a, b)

    def zerosInit(self) -> None:
        """The full collection set to zeros."""
        self._init_values("zeros")

    def uniformDistributionInit(self, low, high) -> None:
        """The full collection drawn uniformly from ``[low, high)`` (reproducible after
        seeding: see the module docstring for which generator)."""
        self._init_values("uniform", low, high)

    def normalDistributionInit(self, mean, stdDev) -> None:
        """The full collection drawn from a normal distribution (mean, standard deviation)."""
        self._init_values("normal", mean, stdDev)

    def variableTransformer(self, batchSize, posPerBatch, negPerBatch=None):
        return variable_transformer(batchSize, posPerBatch, negPerBatch)

    def beforeForwardPass(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        """Switch the rows at the indexes (positives, then negatives) into the model
        variable's weight."""
        idx = self._retrieval(retrievedPosIndexes, retrievedNegIndexes)
        rows = self._store.get(idx, self._device)
        self._set_groups(idx, rows.device)
        with torch.no_grad():
            self.model_variable.weight.data = rows

    def afterOptimizerStep(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        """Write the model variable's updated rows back at the same indexes."""
        idx = self._retrieval(retrievedPosIndexes, retrievedNegIndexes)
        # Every copy of a repeated row took the same step, so any copy is the row's update.
        self._store.put(idx, self.model_variable.weight.data)
        self._groups = None

    def _set_groups(self, idx, device) -> None:
        host = idx.get() if hasattr(idx, "get") else idx
        unique, groups = np.unique(host, return_inverse=True)
        if unique.size == host.size:
            self._groups = None  # no repeats: the gradient is already per row
            return
        self._num_unique = unique.size
        self._groups = torch.from_numpy(groups.reshape(-1)).to(device)

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


def _probe_state(optimizer: torch.optim.Optimizer, param, width: int):
    """``probe_row_state``, its error naming SpeedTorch's argument (an optimizer that cannot be
    stepped row by row, or whose state spans rows, is refused)."""
    try:
        return probe_row_state(optimizer, param, width)
    except ValueError as err:
        raise ValueError(f"given_optimizer: {err}") from err


class OptimizerSwitch:
    """The optimizer's per-row state of one model variable switched with its rows.

    Every state tensor the optimizer keeps with the variable's shape (``optVarList``: Adam's
    ``exp_avg`` and ``exp_avg_sq``, Adagrad's ``sum``, RMSprop's ``square_avg``, ...) gets a
    full collection, created by ``optInit()`` holding the optimizer's own initial state (not
    zeros: Adagrad's ``initial_accumulator_value`` is kept). The state is found by parameter,
    not by position in ``optimizer.state_dict()`` as SpeedTorch does (which no longer holds on
    torch 2.x), and works with every torch.optim optimizer whose state is per row (Adafactor's
    factored state spans rows: refused with a ValueError at construction)."""

    def _setup_optimizer(self, given_optimizer, total_classes, embed_dimension, model,
                         variable_name) -> None:
        self.given_optimizer = given_optimizer
        self.total_classes = int(total_classes)
        self.embed_dimension = int(embed_dimension)
        self.model, self.variable_name = model, variable_name
        params = dict(model.named_parameters())
        name = variable_name if variable_name in params else f"{variable_name}.weight"
        if name not in params:
            raise ValueError(f"variable_name: the model has no parameter {variable_name!r} (or "
                             f"{variable_name}.weight); it has {sorted(params)}")
        self.param = params[name]
        order = [p for g in given_optimizer.param_groups for p in g["params"]]
        keys = [i for i, p in enumerate(order) if p is self.param]
        if not keys:
            raise ValueError(f"variable_name: {name} is not among given_optimizer's parameters")
        self.optimizerKey = keys[0]  # its number in optimizer.state_dict()["state"]
        self._fresh = _probe_state(given_optimizer, self.param, self.embed_dimension)
        self.optVarList = list(self._fresh)
        self._stores = None

    # Each family's subclass defines ``_new_store()``: the empty collection of one state
    # tensor, placed where that family keeps its collections (pinned CPU, GPU, CuPy memory).

    @property
    def _store(self) -> Store:
        return self._require_stores()[0]

    def optInit(self) -> None:
        """Create the full state collections, each row holding the optimizer's initial state."""
        stores = []
        for name in self.optVarList:
            store = self._new_store()
            store.empty((self.total_classes, self.embed_dimension), self._dtype)
            store.fill(self._fresh[name])
            stores.append(store)
        self._stores = stores

    def _require_stores(self):
        if self._stores is None:
            raise RuntimeError("call optInit() before switching optimizer state")
        return self._stores

    def _indices(self, pos, neg):
        idx = reshaped_retrieval(pos, neg)
        stores = self._require_stores()
        if not stores:
            return None
        return as_index(idx, stores[0].num_rows, gpu=self.param.device.type == "cuda")[0]

    def beforeForwardPass(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        """Switch the state rows at the indexes into the optimizer (from its second step on:
        before the first, the optimizer creates its fresh state itself)."""
        stores = self._require_stores()
        state = self.given_optimizer.state.get(self.param)
        if not stores or not state:
            return
        idx = self._indices(retrievedPosIndexes, retrievedNegIndexes)
        # The state lives beside the switched-in weight (the model switcher moved it).
        device = self.param.device
        for name, store in zip(self.optVarList, stores):
            state[name] = store.get(idx, device).to(self.param.dtype)

    def afterOptimizerStep(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        """Write the optimizer's updated state rows back at the same indexes."""
        stores = self._require_stores()
        state = self.given_optimizer.state.get(self.param, {})
        if not stores or not state:
            return
        idx = self._indices(retrievedPosIndexes, retrievedNegIndexes)
        for name, store in zip(self.optVarList, stores):
            store.put(idx, state[name])
