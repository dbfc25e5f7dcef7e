"""``HostEmbeddingBag`` and ``HostEmbedding``: torch modules over a table in pinned host RAM.

The table (weights and optimizer state) stays in pinned host RAM; a forward pass pools the
rows of the batch on ``device`` and a backward pass runs the table's sparse optimizer on the
touched rows (fused into backward, as FBGEMM's tables do), so there is no optimizer to step
for these modules. Their conventions are ``torch.nn.EmbeddingBag``'s and ``torch.nn.Embedding``'s.

With a fused optimizer, ``sum`` or ``mean`` pooling and a private table, a module is a
one-table embedding collection (``host_collection.py``: the engine of
``EmbeddingBagCollection``, rows pooled as they are read, one fused backward + update);
``mode="max"``, ``optimizer=None``, a table shared by a process group and the ``"lfu"``
cache policy run on an :class:`xferlib.HostTable`, whose lookups bring the batch's rows to
``device`` before torch pools them.

With ``optimizer=None`` the modules instead expose the batch's rows as the parameter
``weight`` (its ``.data`` is the batch's unique rows, ``len(unique) x dim``) and ANY
``torch.optim`` optimizer trains them: around ``optimizer.step()`` (global step hooks) the
rows' per-row optimizer state is swapped in from pinned host arrays and the updated rows and
state are written back. Per-parameter scalar state (Adam's ``step``) is shared by all rows, as
in a dense table. Rows a batch sees for the first time start from the optimizer's state after
a step with a zero gradient (its initial state for every torch.optim optimizer, except SGD
with dampening, whose first step copies the gradient).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from xferlib.adapters.torch._convert import (as_core_array, current_stream, fresh_row_state,
                                             gather_to_torch, scatter_from_torch)
from xferlib.adapters.torch.groups import resolve_group
from xferlib.adapters.torch.host_collection import (CollectionTable, bag_layout,
                                                    collection_serves, single_table_bags,
                                                    weights_gradient_path)
from xferlib.adapters.torch.host_dist import SharedTableGroup, build_shared_table
from xferlib.adapters.torch.host_hooks import follow_steps
from xferlib.adapters.torch.tt_dist import agree_forward
from xferlib.backend import cupy_available
from xferlib.memory import pinned_empty
from xferlib.perf import warn_once
from xferlib.sizes import integral_size
from xferlib.table import HostTable

__all__ = ["HostEmbeddingBag", "HostEmbedding"]


class _RowsOfForward(torch.autograd.Function):
    """``optimizer=None``: the module's ``weight`` as one training forward saw it (its rows
    are the forward's batch). Its backward refuses to run after a later forward replaced the
    rows: the gradient would land on the other batch's rows."""

    @staticmethod
    def forward(ctx, weight, module, generation):
        ctx.module, ctx.generation = module, generation
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        if ctx.module._generation != ctx.generation:
            raise RuntimeError(f"{type(ctx.module).__name__}(optimizer=None): a later forward "
                               f"replaced the rows this output was computed from; with "
                               f"optimizer=None each training forward's backward and "
                               f"optimizer.step() come before the next forward (or use a "
                               f"fused optimizer, optimizer='adam' say)")
        return grad, None, None


class _HostRows(torch.autograd.Function):
    """Rows of the module's table at ``idx``; backward runs the table's fused optimizer."""

    @staticmethod
    def forward(ctx, anchor, module, idx):
        ctx.module = module
        ctx.save_for_backward(idx)
        # Under a process group a bad index must reach backward's collective, which raises
        # it on every rank: raised here, on one rank, it would leave the others waiting.
        defer = anchor.requires_grad and module._dist is not None
        if not anchor.requires_grad:  # inference: no update follows, no state gathered
            ctx.batch = None
            return module._lookup(idx)
        rows, ctx.batch = module._lookup(idx, return_batch=True, defer_index_errors=defer)
        return rows

    @staticmethod
    def backward(ctx, grad_rows):
        (idx,) = ctx.saved_tensors
        ctx.module._apply_gradients(idx, grad_rows, ctx.batch)
        ctx.batch = None
        return None, None, None


def _default_device(device):
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class _HostModule(torch.nn.Module):
    def __init__(self, num_embeddings, embedding_dim, *, optimizer, optimizer_kwargs,
                 cache_rows, padding_idx, device, init, cache_policy="lru", seed=None,
                 process_group="default", mode="sum", cuda_graphs=False):
        super().__init__()
        # integers only, as torch.nn.EmbeddingBag: int(10.7) would build 10 rows without a word
        self.num_embeddings = integral_size("num_embeddings", num_embeddings)
        self.embedding_dim = integral_size("embedding_dim", embedding_dim)
        cache_rows = integral_size("cache_rows", cache_rows)  # checked even where unused (CPU)
        if padding_idx is not None:
            padding_idx = integral_size("padding_idx", padding_idx)
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx must be within [-{self.num_embeddings}, "
                                 f"{self.num_embeddings}), got {padding_idx}")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx
        self.device = _default_device(device)
        if self.device.type == "cuda" and not cupy_available():
            raise ValueError("a CUDA device needs CuPy (pip install xferlib[cuda12] or [cuda13])")
        self._dist = None
        self.__dict__["_bags"] = None  # the collection engine (not a submodule: see state_dict)
        group = resolve_group(process_group)
        if cache_policy not in ("lru", "lfu"):
            raise ValueError(f"cache_policy must be 'lru' or 'lfu', got {cache_policy!r}")
        if collection_serves(optimizer, group, cache_policy, mode, self.num_embeddings):
            self.__dict__["_bags"] = single_table_bags(
                self.num_embeddings, self.embedding_dim, optimizer=optimizer,
                optimizer_kwargs=optimizer_kwargs, cache_rows=cache_rows, device=self.device,
                init=init, mode=mode, seed=seed, cuda_graphs=cuda_graphs)
        elif cuda_graphs:
            raise ValueError("cuda_graphs=True replays the collection engine's steps: it needs "
                             "a fused optimizer, mode 'sum' or 'mean', a private table "
                             "(process_group=None or no group) and cache_policy='lru'")
        if self._bags is not None:
            self.table = CollectionTable(self._bags)
            self._zero_padding_row(self.table)
        elif group is not None:  # one table for the group's ranks (host_dist.py)
            if cache_rows:
                warn_once(("shared-table-cache", id(self)),
                          f"cache_rows={cache_rows} is not used: a host table shared by a "
                          f"process group has no GPU cache (every rank reads every row "
                          f"from host RAM)")
            self.table = build_shared_table(
                group, num_embeddings, embedding_dim, "float32", optimizer, optimizer_kwargs,
                init=init, seed=seed, padding_idx=padding_idx, prepare=self._zero_padding_row)
            self._dist = SharedTableGroup(group, self.table, self.device)
        else:
            self.table = HostTable(num_embeddings, embedding_dim, "float32", optimizer,
                                   optimizer_kwargs,
                                   cache_rows if self.device.type == "cuda" else 0,
                                   init=init, cache_policy=cache_policy, seed=seed)
            self._zero_padding_row(self.table)
        self._any_optimizer = optimizer is None
        if self._any_optimizer:
            self.weight = torch.nn.Parameter(torch.empty(0, self.embedding_dim,
                                                         device=self.device))
            self._batch_rows = None
            self._generation, self._stepped = 0, True
            self._host_state = {}
            self._fresh_state = None
            self._follow_steps()

    def _follow_steps(self) -> None:
        """``optimizer=None``: torch.optim's step hooks swap this module's rows' state."""
        follow_steps(self)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if self.__dict__.get("_any_optimizer"):  # a copy (deepcopy, pickle) trains too
            self._follow_steps()

    def _zero_padding_row(self, table) -> None:
        if self.padding_idx is not None:  # as torch: the padding row starts at zero
            table.scatter(np.array([self.padding_idx]), np.zeros((1, self.embedding_dim),
                                                                 np.float32))

    @property
    def process_group(self):
        """The torch.distributed group sharing this module's table, or None."""
        return None if self._dist is None else self._dist.group

    # ------------------------------------------------------------------ transfers

    def _core_indices(self, idx: torch.Tensor):
        return as_core_array(idx.to(self.device).contiguous())

    def _lookup(self, idx: torch.Tensor, return_batch: bool = False,
                defer_index_errors: bool = False):
        out = torch.empty((idx.shape[0], self.embedding_dim), dtype=torch.float32,
                          device=self.device)
        stream = {"stream": current_stream(self.device)} if self.device.type == "cuda" else {}
        core_idx, self._prefetched = self._prefetched_for(idx), None
        try:
            # return_batch: the update reads the rows from the lookup's copy (with their state)
            found = self.table.lookup(core_idx if core_idx is not None
                                      else self._core_indices(idx), out=as_core_array(out),
                                      return_batch=return_batch, **stream)
            batch = found[1] if return_batch else None
        except IndexError:
            if not defer_index_errors:
                raise
            out.zero_()  # backward raises it on every rank, before any update
            batch = None
        return (out, batch) if return_batch else out

    def _prefetched_for(self, idx: torch.Tensor):
        """The core indices given to the table's prefetch when ``idx`` is that batch."""
        prefetched = getattr(self, "_prefetched", None)
        if prefetched is None:
            return None
        tensor, core_idx = prefetched
        if (idx.device == tensor.device and idx.dtype == tensor.dtype
                and idx.shape == tensor.shape and idx.data_ptr() == tensor.data_ptr()):
            return core_idx
        return None

    def prefetch(self, input, offsets=None) -> None:
        """Start moving the rows of the next batch (the ``input`` the next forward will get,
        the same tensor) to the GPU on a side stream, while the current step computes; the
        next forward of that batch reads them from HBM. Updates queued in between (this
        step's backward) are seen by it. ``offsets`` is accepted for symmetry with
        :meth:`forward` and not needed.

        A prefetch is a hint, so where there is nothing to move ahead it does nothing (after
        the same dtype check as :meth:`forward`), and one training loop runs unchanged on a
        CPU machine and a GPU one: on the CPU (lookups read host RAM directly, as
        :meth:`xferlib.HostTable.prefetch` with NumPy indices), with ``optimizer=None``
        (rows are looked up per step), under a process group (other ranks' updates would
        make prefetched rows stale) and on the collection engine (a fused optimizer with sum
        or mean pooling: its kernels read host rows over the link as they pool them, and
        its cache keeps the hot ones in HBM)."""
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"indices must be int32 or int64, got {input.dtype}")
        if (self.device.type != "cuda" or self._any_optimizer or self._dist is not None
                or self._bags is not None):
            return
        flat = input.to(self.device).reshape(-1)
        if self.padding_idx is not None:
            return  # the padding row is filtered per batch: no stable index object to reuse
        core_idx = self._core_indices(flat)
        self.table.prefetch(core_idx, stream=current_stream(self.device))
        self._prefetched = (flat, core_idx)

    def check(self) -> None:
        """Raise for a bad batch whose check is still pending (see ``HostTable.check``)."""
        self.table.check()

    def _apply_gradients(self, idx: torch.Tensor, grad_rows: torch.Tensor, batch=None) -> None:
        grad_rows = grad_rows.to(device=self.device, dtype=torch.float32).contiguous()
        if self.padding_idx is not None:  # the padding row is never updated
            keep = idx.to(self.device) != self.padding_idx
            idx, grad_rows, batch = idx.to(self.device)[keep], grad_rows[keep], None
        if self._dist is not None:
            self._dist.apply(idx, grad_rows)
            return
        target = batch if batch is not None else self._core_indices(idx)
        self.table.apply_gradients(target, as_core_array(grad_rows),
                                   stream=current_stream(self.device))

    def forward(self, *args, **kwargs):
        """``torch.nn.EmbeddingBag``'s or ``torch.nn.Embedding``'s forward (``_forward``).
        A training forward of ranks sharing a table on the CPU: every rank learns whether
        some rank's batch was refused and raises (a small all_reduce), so none waits for the
        others in the backward's collective. (An index out of range travels in the
        backward's own collective, on every device.)"""
        if self._dist is None or self.device.type != "cpu" or not (
                torch.is_grad_enabled() and self.training):
            return self._forward(*args, **kwargs)
        what = f"a {type(self).__name__} sharing its table"
        try:
            out = self._forward(*args, **kwargs)
        except (IndexError, ValueError, TypeError, NotImplementedError, RuntimeError) as err:
            agree_forward(self._dist.group, self.device, err, what)  # raises on every rank
            raise
        agree_forward(self._dist.group, self.device, None, what)
        return out

    def _pooled(self, input, offsets, per_sample_weights, include_last_offset):
        """The collection engine's pooled bags (``host_collection.py``)."""
        indices, offsets, weights = bag_layout(
            input, offsets, per_sample_weights, include_last_offset=include_last_offset,
            padding_idx=self.padding_idx, device=self.device)
        self._bags.training = self.training
        if weights is None or not (weights.requires_grad and torch.is_grad_enabled()):
            return self._bags(indices, offsets, weights)
        # weights that learn: the engine pools with them, torch gives them their gradient
        # (its path made first: it refuses bad offsets before the engine queues anything)
        path = weights_gradient_path(self._bags, indices, offsets, weights)
        return self._bags(indices, offsets, weights.detach()) + path

    def _rows(self, flat_idx: torch.Tensor):
        """The batch's rows and, for each position, its row among them."""
        if flat_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"indices must be int32 or int64, got {flat_idx.dtype}")
        flat_idx = flat_idx.to(self.device)
        if self._any_optimizer:
            # Range check before torch.unique; then the unique rows become `weight`.
            if flat_idx.numel():
                low, high = int(flat_idx.min()), int(flat_idx.max())
                if low < 0 or high >= self.num_embeddings:
                    bad = low if low < 0 else high
                    position = int((flat_idx == bad).nonzero()[0, 0])
                    raise IndexError(f"index {bad} at position {position} is out of range for "
                                     f"a table of {self.num_embeddings} rows")
            uniq, inverse = torch.unique(flat_idx, return_inverse=True)
            if not (torch.is_grad_enabled() and self.training):  # no step follows
                return self._lookup(uniq), inverse
            grad = self.weight.grad
            if grad is not None and not self._stepped and bool(grad.any()):
                raise RuntimeError(f"{type(self).__name__}(optimizer=None): a forward after a "
                                   f"backward whose gradient no optimizer.step() has used "
                                   f"(gradient accumulation over forwards is not supported "
                                   f"with optimizer=None): step first, or use a fused "
                                   f"optimizer (optimizer='adam' say)")
            with torch.no_grad():
                self.weight.data = self._lookup(uniq)
                self.weight.grad = None
            self._batch_rows = uniq
            self._generation, self._stepped = self._generation + 1, False
            return _RowsOfForward.apply(self.weight, self, self._generation), inverse
        anchor = torch.empty(0, device=self.device,
                             requires_grad=torch.is_grad_enabled() and self.training)
        rows = _HostRows.apply(anchor, self, flat_idx)
        return rows, torch.arange(flat_idx.numel(), device=self.device)

    def _pad_position(self, flat_idx, positions, rows):
        """Positions of the padding row point at an extra zero row excluded by padding_idx."""
        if self.padding_idx is None:
            return positions, rows, None
        extra = rows.shape[0]
        rows = torch.cat([rows, rows.new_zeros(1, self.embedding_dim)])
        positions = torch.where(flat_idx.to(self.device) == self.padding_idx, extra, positions)
        return positions, rows, extra

    # ------------------------------------------------------------------ any torch optimizer

    def _before_step(self, optimizer) -> None:
        if self._batch_rows is None or self.weight.grad is None:
            return
        state = optimizer.state.get(self.weight)
        if not state:
            return
        if not self._host_state:  # state made before any batch (Adagrad's, in its __init__)
            self._allocate_host_state(optimizer, state)
        rows = self._core_indices(self._batch_rows)
        for name, host in self._host_state.items():
            state[name] = gather_to_torch(host, rows, self.device)

    def _after_step(self, optimizer) -> None:
        if self._batch_rows is None or self.weight.grad is None:
            return
        rows_t = self._batch_rows
        state = optimizer.state.get(self.weight, {})
        if not self._host_state:
            self._allocate_host_state(optimizer, state)
        rows = self._core_indices(rows_t)
        if rows_t.numel():  # an empty batch's step moved no row: nothing to write back
            for name, host in self._host_state.items():
                scatter_from_torch(host, rows, state[name], self.device)
            with torch.no_grad():
                self.table.scatter(rows, as_core_array(self.weight.data.contiguous()),
                                   stream=current_stream(self.device))
        self._stepped = True

    def _allocate_host_state(self, optimizer, state) -> None:
        """Per-row state arrays for every state tensor shaped like the rows, filled with the
        state a fresh row gets."""
        fresh = fresh_row_state(optimizer, self.weight, state, self.embedding_dim)
        for name, values in fresh.items():
            host = self._host_array()
            host[...] = values
            self._host_state[name] = host

    def _host_array(self) -> np.ndarray:
        """A per-row state array in host RAM (pinned beside a GPU)."""
        alloc = pinned_empty if self.device.type == "cuda" else np.empty
        return alloc((self.num_embeddings, self.embedding_dim), np.float32)

    # ------------------------------------------------------------------ state_dict

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The table, not the per-batch `weight`, is this module's state: a copy of the
        # weights and of every optimizer state array (use table.save for huge tables).
        destination[prefix + "weight"] = torch.from_numpy(np.array(self.table.numpy()))
        for name in self.table.state_names():
            destination[prefix + "table_state." + name] = torch.from_numpy(
                np.array(self.table.state(name)))
        for name, host in getattr(self, "_host_state", {}).items():
            self._sync()
            destination[prefix + "optimizer_state." + name] = torch.from_numpy(np.array(host))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        expected = {prefix + "weight"} | {prefix + "table_state." + n
                                          for n in self.table.state_names()}
        for key in expected:
            if key not in state_dict:
                missing_keys.append(key)
        for key in state_dict:
            if key.startswith(prefix) and key not in expected and not key.startswith(
                    prefix + "optimizer_state."):
                unexpected_keys.append(key)
        # torch's rule (it passes strict=True here whatever the caller's strict, and judges
        # missing keys after the load): the arrays given are loaded, the others keep their
        # values (a plain nn.EmbeddingBag's state dict loads its weights with strict=False).
        # A table shared by a process group is written by rank 0 alone from its own dict, so
        # there every array must be given (ranks giving different keys would each expect
        # another result).
        given = [k in state_dict for k in expected]
        refused = not all(given) if self._dist is not None else not any(given)
        if refused and any(given):
            error_msgs.append(f"{prefix or 'module'}: a table shared by a process group loads "
                              f"whole state dicts only (its weights and every table_state "
                              f"array); nothing was loaded")
        rows_shape = (self.num_embeddings, self.embedding_dim)
        own_state = {key[len(prefix + "optimizer_state."):]: value
                     for key, value in state_dict.items()
                     if key.startswith(prefix + "optimizer_state.")}
        state_shapes = {} if refused else {n: tuple(self.table.state(n).shape)
                                           for n in self.table.state_names()}
        # Every shape checked on every rank before anything is written (a shared table is
        # written by rank 0 alone, whose restore would raise after the others went on).
        shapes = {} if refused else {
            **({prefix + "weight": (state_dict[prefix + "weight"], rows_shape)}
               if prefix + "weight" in state_dict else {}),
            **{prefix + "table_state." + n: (state_dict[prefix + "table_state." + n], shape)
               for n, shape in state_shapes.items() if prefix + "table_state." + n in state_dict},
            **{prefix + "optimizer_state." + n: (value, rows_shape)
               for n, value in own_state.items() if getattr(self, "_any_optimizer", False)}}
        for key, (value, shape) in shapes.items():
            if tuple(value.shape) != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(value.shape)}, the table has shape {shape}")
                refused = True
        # A shared table: every rank learns whether any refused before rank 0 writes (a
        # rank that returned alone would leave the others waiting in the fence below).
        if self._dist is not None and self._dist.any_rank(refused) and not refused:
            error_msgs.append("another rank of the group refused its state dict; the shared "
                              "table is unchanged")
            refused = True
        if refused:
            return
        if self._dist is None or self._dist.rank == 0:  # a shared table is written once
            arrays = {key[len(prefix):]: value.detach().cpu().numpy()
                      for key, value in state_dict.items() if key in expected}
            self.table.restore(arrays.pop("weight", None),
                               {key[len("table_state."):]: value
                                for key, value in arrays.items()}, partial=True)
        if self._dist is not None:
            self._dist.fence()
            # On NCCL the fence only orders the GPU stream: wait for it, so that no rank reads
            # the shared rows from the host before rank 0's restore is through the fence.
            self._sync()
        if getattr(self, "_any_optimizer", False):
            # The rows' torch.optim state is the checkpoint's: a name it lacks (a module that
            # never stepped) starts afresh at the next step, not from this module's old rows.
            host_state = {}
            for name, value in own_state.items():
                host = self._host_state.get(name)
                host_state[name] = self._host_array() if host is None else host
                host_state[name][...] = value.detach().cpu().numpy()
            self._host_state = host_state

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, optimizer="
                f"{self.table.optimizer!r}, cache_rows={self.table.cache_rows}, "
                f"device={self.device}")


class HostEmbeddingBag(_HostModule):
    """``torch.nn.EmbeddingBag`` over a table in pinned host RAM, trained in backward.

    Args follow ``torch.nn.EmbeddingBag`` (``mode`` ``"sum"``/``"mean"``/``"max"``,
    ``include_last_offset``, ``padding_idx``), plus ``optimizer`` (a
    :data:`xferlib.SPARSE_OPTIMIZERS` name, fused into backward; None lets any torch.optim
    optimizer train ``weight``), ``optimizer_kwargs`` (torch.optim's names), ``cache_rows``
    (GPU hot-row cache), ``device`` (where outputs live; default CUDA when present),
    ``init`` (as :class:`xferlib.HostTable`; default N(0, 1) like torch), ``process_group``:

    * ``"default"``: torch.distributed's default group when it is initialized with more than
      one rank, else none (one process: a private table, as before);
    * ``None``: a private table in this process, whatever torch.distributed does;
    * a group (of ranks on ONE host): the ranks share one table and its optimizer state in
      host shared memory; each rank looks up its own batch, and backward sums every rank's
      gradients per row (rank order) and applies the optimizer once per row, so N ranks
      train as one process on the concatenated batch (``host_dist.py``). No GPU cache and no
      prefetch there; every rank must run each step's forward and backward.

    With a fused optimizer, ``mode`` ``"sum"`` or ``"mean"`` and a private table (the common
    case) the module is a one-table ``EmbeddingBagCollection`` (``host_collection.py``) and
    ``table`` a :class:`~xferlib.adapters.torch.host_collection.CollectionTable` (HostTable's
    reading and writing methods); otherwise ``table`` is a :class:`xferlib.HostTable`. On the
    collection engine ``per_sample_weights`` that require grad get torch's gradient (the
    batch's rows are then read once more, one per lookup), the GPU's input checks are read
    without a host sync (a bad batch raises from a later call or :meth:`check`; with
    ``padding_idx`` the batch's size is read back to drop the padding lookups), an ``init``
    array is copied into the collection's memory, and ``cuda_graphs=True`` replays each
    batch shape's forward and backward from CUDA graphs (``EmbeddingBagCollection``'s
    option: an eager step costs its launches, not the engine's Python; refused elsewhere).

    >>> import torch
    >>> from xferlib.adapters.torch import HostEmbeddingBag
    >>> bag = HostEmbeddingBag(1000, 8, optimizer="adam", device="cpu")
    >>> out = bag(torch.tensor([1, 2, 4, 5, 4]), torch.tensor([0, 2]))
    >>> out.sum().backward()   # rows 1, 2, 4, 5 took one Adam step
    >>> out.shape
    torch.Size([2, 8])
    """

    def __init__(self, num_embeddings, embedding_dim, *, mode="sum", optimizer="adam",
                 optimizer_kwargs=None, cache_rows=0, include_last_offset=False,
                 padding_idx=None, device=None, init=("normal", 0.0, 1.0),
                 cache_policy="lru", seed=None, process_group="default", cuda_graphs=False):
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, optimizer=optimizer,
                         optimizer_kwargs=optimizer_kwargs, cache_rows=cache_rows,
                         padding_idx=padding_idx, device=device, init=init,
                         cache_policy=cache_policy, seed=seed, process_group=process_group,
                         mode=mode, cuda_graphs=cuda_graphs)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def _forward(self, input, offsets=None, per_sample_weights=None):
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("if input is 2-D, offsets must be None")
        elif input.dim() == 1:
            if offsets is None:
                raise ValueError("offsets has to be a 1-D tensor when input is 1-D")
            if offsets.dim() != 1:
                raise ValueError("offsets has to be a 1-D tensor")
        else:
            raise ValueError(f"input has to be 1-D or 2-D, got {input.dim()}-D")
        if per_sample_weights is not None and self.mode != "sum":
            # torch.nn.EmbeddingBag's contract (weights scale rows before a sum), same error type
            raise NotImplementedError("per_sample_weights are supported for mode='sum' only "
                                      f"(as torch), got mode={self.mode!r}")
        if self._bags is not None:
            return self._pooled(input, offsets, per_sample_weights, self.include_last_offset)
        flat = input.reshape(-1)
        rows, positions = self._rows(flat)
        positions, rows, pad = self._pad_position(flat, positions, rows)
        positions = positions.view(input.shape)
        if offsets is not None:
            offsets = offsets.to(self.device)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(self.device)
        return F.embedding_bag(positions, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset, padding_idx=pad)


class HostEmbedding(_HostModule):
    """``torch.nn.Embedding`` over a table in pinned host RAM, trained in backward.

    Same arguments as :class:`HostEmbeddingBag` without ``mode`` and offsets;
    ``forward(input)`` takes indices of any shape and returns ``(*input.shape, dim)``.
    """

    def __init__(self, num_embeddings, embedding_dim, *, optimizer="adam",
                 optimizer_kwargs=None, cache_rows=0, padding_idx=None, device=None,
                 init=("normal", 0.0, 1.0), cache_policy="lru", seed=None,
                 process_group="default", cuda_graphs=False):
        super().__init__(num_embeddings, embedding_dim, optimizer=optimizer,
                         optimizer_kwargs=optimizer_kwargs, cache_rows=cache_rows,
                         padding_idx=padding_idx, device=device, init=init,
                         cache_policy=cache_policy, seed=seed, process_group=process_group,
                         cuda_graphs=cuda_graphs)

    def _forward(self, input):
        flat = input.reshape(-1)
        if self._bags is not None:  # a bag of one lookup per index
            bounds = torch.arange(flat.shape[0] + 1, device=self.device, dtype=torch.int64)
            return self._pooled(flat, bounds, None, True).view(*input.shape,
                                                               self.embedding_dim)
        rows, positions = self._rows(flat)
        if self._any_optimizer or self.padding_idx is not None:
            positions, rows, _ = self._pad_position(flat, positions, rows)
            rows = rows.index_select(0, positions)
        return rows.view(*input.shape, self.embedding_dim)
