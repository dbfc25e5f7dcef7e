"""``EmbeddingBagCollection``: every embedding table of a model as one torch module.

A thin module over the core's :class:`xferlib.collection.EmbeddingCollection` (TorchRec's
name, FBGEMM's input layout): the forward is the collection's pooled lookup of every table,
written into a tensor torch allocates; the backward is the collection's fused backward +
update, so the tables train inside ``loss.backward()`` and no torch optimizer steps them. The
module holds no math and no training state of its own: rows, optimizer state and step counts
are the core collection's, the deferred GPU input checks too.

On CUDA the collection's kernels run on torch's current stream without a host sync, and
while torch captures a CUDA graph CuPy takes its scratch memory from torch's allocator (the
graph's pool), so a whole training step (this module, a dense model and a capturable
``FlatAdam``) can be captured and replayed.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from xferlib.adapters.torch._convert import as_core_array, cupy_stream
from xferlib.adapters.torch.collection_graphs import GraphedLookup, StepGraphs
from xferlib.adapters.torch.tt_batched import on_stream
from xferlib.collection import EmbeddingCollection, TableConfig

__all__ = ["EmbeddingBagCollection", "TableConfig"]

# state_dict keys: "<prefix>embedding_bags.<table>.weight", as TorchRec names a collection's
# tables, and "<prefix>embedding_bags.<table>.<optimizer state>" beside them.
_STATE = "embedding_bags."
_DTYPES = {torch.float32: "float32", torch.float64: "float64"}


class TrainInPlace(torch.autograd.Function):
    """A pooled lookup whose backward trains the tables in place and gives no gradient back
    (as FBGEMM's table-batched embeddings do): forward calls ``module._train_forward(indices,
    offsets, per_sample_weights) -> (out, saved)``, backward ``module._train_backward(saved,
    grad)``, once (used by this module and the sharded one).

    ``anchor``, an empty tensor that requires grad, is what makes the output require grad, so
    that autograd calls backward; it is no parameter, so optimizers and DDP never see it.
    ``watched``: the caller's input tensors the forward's context reads in place (views):
    one changed in place before the backward is refused there, as torch refuses a modified
    saved tensor (the update would train other rows than the lookup read)."""

    @staticmethod
    def forward(ctx, anchor, module, indices, offsets, per_sample_weights, watched=()):
        out, ctx.saved = module._train_forward(indices, offsets, per_sample_weights)
        ctx.module = module
        ctx.versions = [(t, t._version) for t in watched]
        return out

    @staticmethod
    def backward(ctx, grad):
        saved, ctx.saved = ctx.saved, None  # the step's buffers are freed with it
        if saved is None:
            raise RuntimeError(f"the update of {type(ctx.module).__name__} already ran for "
                               f"this forward (backward through its output runs once; "
                               f"retain_graph=True cannot train the tables twice)")
        if any(t._version != v for t, v in ctx.versions):
            raise RuntimeError(f"an input of {type(ctx.module).__name__}'s forward (indices, "
                               f"offsets or per_sample_weights) was modified in place before "
                               f"its backward: the update would train other rows than the "
                               f"lookup read; nothing was updated")
        ctx.module._train_backward(saved, grad)
        return None, None, None, None, None, None


def _default_device(device) -> torch.device:
    device = torch.device(device if device is not None else
                          "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r} needs a CUDA GPU that torch sees; none "
                           f"here (use device='cpu', the NumPy path)")
    if device.type == "cuda" and device.index is None:
        # The collection's memory lives on one GPU: pin the index down now, so outputs are
        # allocated there whatever torch's current device is later.
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"an EmbeddingBagCollection lives on a 'cpu' or 'cuda' device, got "
                         f"{device}")
    return device


def _core_dtype(dtype) -> str:
    if dtype not in _DTYPES:
        raise TypeError(f"an EmbeddingBagCollection stores torch.float32 or torch.float64 rows, "
                        f"got {dtype}")
    return _DTYPES[dtype]


class EmbeddingBagCollection(torch.nn.Module):
    """T embedding tables, one pooled lookup of all of them and one fused backward + update.

    Args:
      tables: :class:`~xferlib.collection.TableConfig` per table (rows, width, name,
        placement ``"hbm"``, ``"host"`` or ``"tt"`` (TT cores, ``tt_ranks=``), learning
        rate, initializer).
      optimizer: a :data:`xferlib.SPARSE_OPTIMIZERS` name (``"sgd"``, ``"adam"``, ``"adamw"``,
        ``"adagrad"``, ``"rowwise_adagrad"``, ...), fused into backward; lazy semantics (rows
        not looked up keep their weights and state).
      optimizer_kwargs: its hyperparameters, torch.optim's names and defaults.
      pooling: ``"sum"`` or ``"mean"`` (an empty bag pools to zeros).
      dtype: ``torch.float32`` or ``torch.float64`` (the CPU path) rows and outputs.
      device: ``"cuda"`` (default where torch sees a GPU; needs CuPy) or ``"cpu"`` (the NumPy
        path). Inputs are moved to it.
      seed: for the tables' initializers (table ``t`` draws from ``seed + t``).
      cuda_graphs: replay each batch shape's training forward and backward from CUDA graphs
        captured at its second call (a shape: B, the dtypes and the number of indices
        rounded up to one of eight sizes per power of two, so batches of changing lengths
        share graphs; ``adapters/torch/collection_graphs.py``): an eagerly
        called module's step then costs its launches and torch's autograd, not the core's
        Python (on an H200, 0.4-0.7 ms of host time a step instead of 1.1-1.8), with the
        same results bit for bit. Off by default; ignored on the CPU and inside a CUDA
        graph the caller captures.

    ``forward(indices, offsets, per_sample_weights=None)`` takes FBGEMM's layout: ``indices``
    (int32 or int64, every table's lookups, table after table), ``offsets`` (``T * B + 1``
    bag boundaries into ``indices``), optional ``per_sample_weights`` (one per index; they
    scale rows before the pooling and get no gradient). ``forward({name: (indices,
    offsets)})`` takes one entry per table instead (``offsets`` of ``B + 1``; a third
    element for per-sample weights). It returns ``(B, total_dim)`` pooled rows, table ``t``
    at columns ``dim_offsets[t]:dim_offsets[t + 1]`` (:meth:`split` gives them by name).

    Training (grad enabled and ``module.training``): ``loss.backward()`` runs the
    collection's optimizer on every looked-up row. In ``eval()`` mode or under
    ``torch.no_grad()`` the forward is a lookup only. Bad input raises the core's errors
    (IndexError, ValueError, TypeError) before any table changes; on CUDA the value checks are
    read without a host sync, so a bad batch raises from a later call or :meth:`check`.

    ``state_dict()`` holds every table's weights and optimizer state
    (``embedding_bags.<table>.weight``, ``embedding_bags.<table>.<state>``; a tt table's
    cores, their state and its step counter: ``embedding_bags.<table>.core<k>``,
    ``embedding_bags.<table>.core<k>.<state>``, ``embedding_bags.<table>.step``), and
    ``load_state_dict`` checks every shape before any table changes (a mismatch writes
    nothing); as for torch's parameters, the arrays given are loaded and the keys it lacks
    keep their values (reported as missing: ``strict=False`` loads another optimizer's
    weights or a subset of the tables). ``.to(device)``, ``.cuda()``,
    ``.cpu()``, ``.double()`` rebuild the core collection on the new device or dtype from its
    state (a copy of every table; hyperparameters set by ``collection.set_hyper`` carried
    over). The module has no parameters and no buffers: DistributedDataParallel syncs the
    dense model beside it and leaves it alone (each rank's tables train on its own batches).

    >>> import torch
    >>> from xferlib.adapters.torch import EmbeddingBagCollection, TableConfig
    >>> ebc = EmbeddingBagCollection([TableConfig(10, 4, name="user", init="zeros"),
    ...                               TableConfig(20, 2, name="item", init="zeros")],
    ...                              "sgd", {"lr": 1.0}, device="cpu")
    >>> indices = torch.tensor([1, 1, 3, 5])   # user: bags [1, 1], [3]; item: [5], []
    >>> offsets = torch.tensor([0, 2, 3, 4, 4])  # T * B + 1 = 2 * 2 + 1
    >>> pooled = ebc(indices, offsets)
    >>> pooled.shape
    torch.Size([2, 6])
    >>> pooled.sum().backward()                # SGD on rows user 1, user 3, item 5
    >>> ebc.collection.weights("user")[1].tolist()  # looked up twice: -2
    [-2.0, -2.0, -2.0, -2.0]
    """

    def __init__(self, tables, optimizer: str = "sgd", optimizer_kwargs=None, *,
                 pooling: str = "sum", dtype=torch.float32, device=None, seed: int | None = 0,
                 cuda_graphs: bool = False):
        super().__init__()
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
        self.device = _default_device(device)
        self._graphs = StepGraphs() if cuda_graphs else None
        self.dtype = dtype
        self._spec = dict(optimizer=optimizer, optimizer_kwargs=dict(optimizer_kwargs or {}),
                          pooling=pooling)
        with self._on_device():
            self.collection = EmbeddingCollection(
                tables, optimizer, optimizer_kwargs, pooling=pooling,
                dtype=_core_dtype(dtype), device=self.device.type, seed=seed)
        self.tables = self.collection.tables  # the configs as given (a rebuild keeps them)

    # ------------------------------------------------------------------ the collection

    @property
    def names(self) -> tuple:
        """The tables' names, in the collection's order (the dict form's keys)."""
        return self.collection.names

    @property
    def dims(self) -> tuple:
        return self.collection.dims

    @property
    def dim_offsets(self) -> tuple:
        """Table ``t``'s columns of the pooled output: ``dim_offsets[t]:dim_offsets[t + 1]``."""
        return self.collection.dim_offsets

    @property
    def total_dim(self) -> int:
        return self.collection.total_dim

    def split(self, pooled: torch.Tensor) -> dict:
        """``{name: (B, dim) view}`` of a pooled output, one per table (no copy)."""
        if pooled.dim() != 2 or pooled.shape[1] != self.total_dim:
            raise ValueError(f"pooled must have shape (B, {self.total_dim}), got "
                             f"{tuple(pooled.shape)}")
        offsets = self.dim_offsets
        return {name: pooled[:, offsets[t]:offsets[t + 1]] for t, name in enumerate(self.names)}

    def check(self) -> None:
        """Raise for a bad GPU batch whose input check is still pending (nothing it touched
        changed); see :meth:`xferlib.collection.EmbeddingCollection.check`."""
        with self._on_device():
            self.collection.check()

    # ------------------------------------------------------------------ forward / backward

    def forward(self, indices, offsets=None, per_sample_weights=None) -> torch.Tensor:
        if isinstance(indices, dict):
            if offsets is not None or per_sample_weights is not None:
                raise ValueError("the dict form {name: (indices, offsets[, weights])} carries "
                                 "each table's offsets and weights: pass nothing else")
            idx, off, psw = self._pack(indices)  # new arrays: nothing to watch
            watched = ()
        else:
            if offsets is None:
                raise ValueError("offsets are needed with flat indices (FBGEMM's layout: "
                                 "T * B + 1 bag boundaries)")
            idx, off = self._core(indices, "indices"), self._core(offsets, "offsets")
            psw = (None if per_sample_weights is None
                   else self._core(per_sample_weights, "per_sample_weights"))
            # the tensors the core reads in place (not the copies _core made of others)
            watched = tuple(t for t in (indices, offsets, per_sample_weights)
                            if t is not None and t.device == self.device
                            and (not t.is_cuda or t.is_contiguous()))
        if not (torch.is_grad_enabled() and self.training):  # no update will follow
            return self._lookup(idx, off, psw, train=False)[0]
        anchor = torch.empty(0, device=self.device, requires_grad=True)
        return TrainInPlace.apply(anchor, self, idx, off, psw, watched)

    def _core(self, tensor, name: str):
        """A core array (NumPy or CuPy view) of ``tensor`` on this module's device."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(tensor).__name__}")
        if name == "per_sample_weights" and tensor.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("the collection computes no gradient for "
                                      "per_sample_weights; pass per_sample_weights.detach()")
        tensor = tensor.to(self.device)
        # CUDA kernels read indices as dense arrays; the NumPy path takes any strides
        return as_core_array(tensor.contiguous() if tensor.is_cuda else tensor)

    def _pack(self, features: dict):
        """FBGEMM's layout from ``{name: (indices, offsets[, weights])}`` (the core's pack)."""
        converted = {}
        for name, entry in features.items():
            if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
                raise ValueError(f"features[{name!r}] must be (indices, offsets) or (indices, "
                                 f"offsets, per_sample_weights), got {type(entry).__name__}")
            parts = ("indices", "offsets", "per_sample_weights")
            converted[name] = tuple(self._core(t, part) for t, part in zip(entry, parts))
        with self._on_device(), self._on_stream():
            packed = self.collection.pack(converted)
        return (*packed, None) if len(packed) == 2 else packed

    def _lookup(self, indices, offsets, per_sample_weights, train: bool, padded: bool = False,
                total=None):
        """``(out, ctx)``: the pooled lookup written into a tensor torch allocates; ``ctx``
        (the core's LookupContext) when an update will follow. ``padded``, ``total``: the
        core's (indices past ``offsets[-1]`` ignored; the last bag ends at ``total[0]``)."""
        T = self.collection.num_tables
        # B as the core derives it; malformed offsets make no sensible B, and the core
        # raises for them (its input checks come before its check of `out`).
        rows = offsets.shape[0] if getattr(offsets, "ndim", 0) == 1 else 1
        out = torch.empty((max(rows - 1, 0) // T, self.total_dim), dtype=self.dtype,
                          device=self.device)
        with self._on_device(), self._on_stream() as stream:
            if not train:
                self.collection.lookup(indices, offsets, per_sample_weights,
                                       out=as_core_array(out), stream=stream, padded=padded)
                return out, None
            _, ctx = self.collection.forward(indices, offsets, per_sample_weights,
                                             out=as_core_array(out), stream=stream,
                                             padded=padded, total=total)
        return out, ctx

    def _train_forward(self, indices, offsets, per_sample_weights):
        if self._graphs is not None and self.device.type == "cuda":
            replayed = self._graphs.forward(self, indices, offsets, per_sample_weights)
            if replayed is not None:
                return replayed
        return self._lookup(indices, offsets, per_sample_weights, train=True)

    def _train_backward(self, lookup, grad: torch.Tensor) -> None:
        if isinstance(lookup, GraphedLookup):
            self._graphs.backward(self, lookup, grad)
            return
        self._update(lookup, grad)

    def _update(self, lookup, grad: torch.Tensor) -> None:
        grad = grad.to(device=self.device, dtype=self.dtype)
        if grad.dim() != 2 or grad.stride(-1) != 1:  # rows of adjacent columns are read in place
            grad = grad.contiguous()
        with self._on_device(), self._on_stream() as stream:
            self.collection.backward(lookup, as_core_array(grad), stream=stream)

    # ------------------------------------------------------------------ device scopes

    def _on_device(self):
        """CuPy's current device made this module's GPU (a no-op on the CPU): the core
        allocates and launches on CuPy's current device."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        import cupy

        return cupy.cuda.Device(self.device.index)

    @contextlib.contextmanager
    def _on_stream(self):
        """torch's current stream as CuPy's (yields it; None on the CPU). While torch
        captures a CUDA graph, CuPy allocates from torch's allocator (``on_stream``)."""
        if self.device.type != "cuda":
            yield None
            return
        stream = cupy_stream(self.device)
        probe = torch.empty(0, device=self.device)  # on_stream reads the device off a tensor
        with on_stream(probe, stream=stream):
            yield stream

    # ------------------------------------------------------------------ state_dict

    def _state_keys(self) -> list:
        """The core's state_dict keys: ``<table>.weight`` and ``<table>.<state>`` (a tt
        table's ``<table>.core<k>``, ``<table>.core<k>.<state>``, ``<table>.step``)."""
        return self.collection.state_keys()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The tables, with their optimizer state, are this module's state: CPU copies.
        with self._on_device():
            state = self.collection.state_dict()
        for key, value in state.items():
            destination[prefix + _STATE + key] = torch.from_numpy(value)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        expected = {prefix + _STATE + key: key for key in self._state_keys()}
        missing = [key for key in expected if key not in state_dict]
        unexpected = [key for key in state_dict
                      if key.startswith(prefix) and key not in expected]
        missing_keys.extend(missing)
        unexpected_keys.extend(unexpected)
        if len(missing) == len(expected):  # none of ours given: nothing to load
            return
        # torch's rule (it passes strict=True here whatever the caller's strict, and judges
        # missing keys after the load): the arrays given are loaded, the others keep their
        # values (only the tables given are rewritten); every shape is checked before any
        # table is written.
        state = {core_key: state_dict[key].detach().cpu().numpy()
                 for key, core_key in expected.items() if key in state_dict}
        try:
            with self._on_device():
                self.collection.load_state_dict(state, partial=bool(missing))
        except ValueError as err:  # shapes that do not match: nothing was written
            error_msgs.append(f"{prefix}{_STATE[:-1]}: {err}")

    # ------------------------------------------------------------------ moving

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .cpu() / .double() reach a module through _apply: ask `fn` where
        # an empty tensor of ours would go, and rebuild the collection there.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        device, dtype = probe.device, probe.dtype
        if device.type == "cuda" and device.index is None:
            device = _default_device(device)
        moved = device != self.device or dtype != self.dtype
        if moved:  # refuse an unsupported target before anything changes
            _core_dtype(dtype)
            _default_device(device)
        result = super()._apply(fn, recurse)
        if moved:
            self._rebuild(device, dtype)
        return result

    def _rebuild(self, device: torch.device, dtype) -> None:
        """The core collection again, on ``device`` with ``dtype`` rows, holding this one's
        weights, optimizer state and hyperparameters."""
        old = self.collection
        with self._on_device():
            state = old.state_dict()
        self.device, self.dtype = device, dtype
        self.collection = self._build(self.tables, state, old.hypers)
        if self._graphs is not None:  # captured on the old collection's buffers
            self._graphs.clear()

    def _build(self, tables, state, hypers) -> EmbeddingCollection:
        # zeros: every row is overwritten by the state at once; a random init would be wasted
        zeros = [dataclasses.replace(t, init="zeros") for t in tables]
        with self._on_device():
            coll = EmbeddingCollection(zeros, self._spec["optimizer"],
                                       self._spec["optimizer_kwargs"],
                                       pooling=self._spec["pooling"],
                                       dtype=_core_dtype(self.dtype), device=self.device.type,
                                       seed=None)
            for t, hyper in enumerate(hypers):
                coll.set_hyper(t, **hyper)
            coll.load_state_dict(state)
        return coll

    def __getstate__(self):
        # copy.deepcopy and torch.save(module): the collection as its configs and state (its
        # buffers are pinned host or GPU memory, which do not pickle).
        state = self.__dict__.copy()
        coll = state.pop("collection")
        if state.get("_graphs") is not None:  # graphs belong to this process and collection
            state["_graphs"] = StepGraphs(state["_graphs"].limit)
        with self._on_device():
            state["_collection"] = (coll.state_dict(), list(coll.hypers))
        return state

    def __setstate__(self, state):
        saved, hypers = state.pop("_collection")
        state.setdefault("_graphs", None)
        super().__setstate__(state)
        self.collection = self._build(self.tables, saved, hypers)

    def extra_repr(self) -> str:
        tables = ", ".join(f"{c.name}: {c.num_rows}x{c.dim} {c.placement}"
                           for c in self.tables)
        return (f"[{tables}], optimizer={self.collection.optimizer!r}, "
                f"pooling={self.collection.pooling!r}, dtype={self.dtype}, "
                f"device={self.device}"
                + (", cuda_graphs=True" if self._graphs is not None else ""))
