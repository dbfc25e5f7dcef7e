"""``TableBatchedTTEmbeddingBag``: several TT tables of one shape in one module (FBTT's API).

The ``T`` tables' cores are stored as FBTT stores them, ``tt_cores[k]`` of shape
``[T, p_k, R_k q_k R_{k+1}]``. Seen as ``[T p_k, ...]`` they are the cores of one larger TT
whose row with digits ``(t p_k + i_k)_k`` is row ``i`` of table ``t``: lookups of every table
run as one batch through one set of kernel launches (and one NumPy pass on the CPU).
``TTEmbeddingBag`` (``xferlib.adapters.torch.tt``) is the one-table case.

The training state (cores, optimizer state, step counter, row cache, input checks, scratch)
is a :class:`xferlib.tt.TTTable`'s: the module keeps the tensors (FBTT's Parameters and
buffers, so checkpoints keep their keys), hands the table views of them, and its autograd
function calls the table's ``lookup`` and ``apply_gradients``.
"""

from __future__ import annotations

import functools
import math

import torch

from xferlib import tt as core
from xferlib.adapters.torch import tt_dist
from xferlib.adapters.torch import tt_fbtt_compat as compat
from xferlib.adapters.torch._convert import (array_of, cupy_stream, on_stream,
                                             stream_capturing)
from xferlib.adapters.torch.groups import resolve_group
from xferlib.adapters.torch.tt_fbtt_compat import CORE_OPTIMIZER, OptimType
from xferlib.sizes import integral_size, integral_sizes
from xferlib.tt.rules import row_state
from xferlib.tt.table import TTTable, draw_tt_tables

__all__ = ["TableBatchedTTEmbeddingBag"]


def _torch(array) -> torch.Tensor:
    from xferlib.handoff import to_torch

    return to_torch(array)


class _BufferList(torch.nn.Module):
    """Buffers named ``<name><i>`` (FBTT's ``BufferList``, so checkpoints keep its keys)."""

    def __init__(self, name: str):
        super().__init__()
        self._name, self._length = name, 0

    def append(self, value: torch.Tensor) -> None:
        self.register_buffer(f"{self._name}{self._length}", value)
        self._length += 1

    def __len__(self) -> int:
        return self._length

    def __iter__(self):
        return (self[i] for i in range(self._length))

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self._length <= i < self._length:
            raise IndexError(f"index {i} out of range for {self._length} buffers")
        return getattr(self, f"{self._name}{i % self._length}")


class _TTBagFunction(torch.autograd.Function):
    """The module's lookup: ``forward`` calls :meth:`xferlib.tt.TTTable.lookup` on views of
    the tensors, ``backward`` its fused update (``sparse=True``) or its gradients."""

    @staticmethod
    def forward(ctx, module, training, indices, offsets, per_sample_weights, cache_weight,
                *cores):
        # training: the step will be differentiated; it reads the GPU input check in backward,
        # before any core changes, so the forward never waits on the device.
        table = module._table()
        device = cores[0]
        gpu = device.is_cuda
        capturing = gpu and torch.cuda.is_current_stream_capturing()
        num_bags = offsets.shape[0] - (1 if module.include_last_offset else 0)
        # float32 (the bags the core table writes), whatever torch's default dtype is
        out = torch.empty((max(num_bags, 0), module.embedding_dim), dtype=torch.float32,
                          device=device.device)
        stream = cupy_stream(device.device) if gpu else None
        with on_stream(device, capturing, stream):
            _, residuals = table.lookup(
                array_of(indices), array_of(offsets), mode=module.mode,
                per_sample_weights=None if per_sample_weights is None
                else array_of(per_sample_weights), include_last_offset=module.include_last_offset,
                # FBTT counts accesses in training forwards
                train=training, count_cache=training and module.training, stream=stream,
                out=array_of(out))
        ctx.module, ctx.residuals, ctx.device, ctx.capturing = module, residuals, device, \
            capturing
        return out

    @staticmethod
    def backward(ctx, grad_out):
        module = ctx.module
        table = module._table()
        none = (None,) * 5
        # the stream autograd runs this backward on (the forward's, unless the caller chose)
        stream = cupy_stream(ctx.device.device) if ctx.device.is_cuda else None
        cores = len(ctx.residuals.cores)
        with on_stream(ctx.device, ctx.capturing, stream):
            grad_bags = array_of(grad_out.contiguous())
            if module.sparse:  # fused: update the cores in place, hand no gradient back
                # data parallel (tt_dist): the core-row gradients summed over the group
                reduce = None if module._group is None else functools.partial(
                    tt_dist.fused_step, group=module._group)
                table.apply_gradients(ctx.residuals, grad_bags, stream=stream, reduce=reduce)
                return none + (None,) * (1 + cores)
            grads, cache_grad = table.grads(ctx.residuals, grad_bags, stream=stream)
        return none + (None if cache_grad is None else _torch(cache_grad),) + tuple(
            _torch(g).view(c.shape) for g, c in zip(grads, module.tt_cores))


def _hyper(name: str, doc: str) -> property:
    """A hyperparameter of the core table as a module attribute (FBTT's names)."""
    def get(self):
        return self.__dict__["_tt"].hyper[name]

    def set_(self, value):
        self.__dict__["_tt"].set_hyper(**{name: value})

    return property(get, set_, doc=doc)


class TableBatchedTTEmbeddingBag(torch.nn.Module):
    """``num_tables`` TT embedding bags of one shape, looked up in one pass (FBTT's API).

    ``forward(indices, offsets, warmup=True, *, per_sample_weights=None)`` (the weights get
    no gradient: ones that require grad raise NotImplementedError): offsets hold
    ``T * B + 1`` bag bounds, table ``t``'s bags being ``t * B .. (t + 1) * B - 1`` (indices of
    every table in one array, each below ``num_embeddings``); returns ``(T, B, dim)``.
    ``warmup`` is accepted for FBTT's call form and, as in FBTT, ignored: the module's own
    ``warmup`` (True until :meth:`cache_populate`) decides whether the cache serves lookups.

    Arguments and defaults are FBTT's. Sizes are integers (a float or a string raises
    TypeError, as torch's sizes). The rows are ``embedding_dim`` wide whatever
    ``enforce_embedding_dim`` says: without ``tt_q_shapes`` the width is factored exactly
    (128 -> [4, 4, 8]). FBTT's flag lets its factorization round the width up (128 -> 200)
    and FBTT then fails its own ``prod(tt_q_shapes) == embedding_dim`` assertion, so calls
    FBTT accepts get the same shapes here and the flag is accepted and changes nothing.
    Indices and offsets are int32 or int64 tensors (TypeError otherwise, as torch's bags;
    FBTT casts any dtype with ``.long()``). Keyword-only extras: ``mode`` ("sum"/"mean"),
    ``include_last_offset``, ``seed`` (initialization), ``betas``, ``weight_decay``, ``eta``
    and ``momentum`` (FBGEMM's hyper-parameters of the Adam / LAMB / LARS rules),
    ``device`` and ``process_group`` (data parallelism, see ``tt_dist``: ``"default"``, the
    default, is torch.distributed's default group when it is initialized with more than one
    rank, else none; ``None``: this process alone; the ranks of a group hold equal cores, sum
    their core-row gradients in the fused backward and equal one process on the global
    batch). The module is built on ``device`` (default: the CPU; FBTT builds on the
    current GPU) and moves with ``.to()``; inputs on another device raise a RuntimeError.

    ``optimizer`` (``sparse=True``: fused into backward, every touched core row): SGD /
    EXACT_SGD; ADAGRAD / EXACT_ADAGRAD; EXACT_ROWWISE_ADAGRAD; ADAM (xferlib's row-wise Adam:
    elementwise first moment, one second moment and step count per row); LAMB, LARS_SGD,
    PARTIAL_ROWWISE_ADAM, PARTIAL_ROWWISE_LAMB as FBGEMM defines them (per core row, one global
    step ``iter``). FBTT itself runs Adagrad for every optimizer but SGD.

    ``use_cache`` (one table only, as in FBTT): ``cache_size`` rows (default 10% of
    ``num_embeddings``) served from dense rows once :meth:`cache_populate` chose them by the
    access counts of training forwards (``hashtbl_size`` slots, default ``num_embeddings``).

    >>> tables = TableBatchedTTEmbeddingBag(2, 100, 8, [3], [10, 10], [2, 4], use_cache=False)
    >>> tables(torch.tensor([1, 2, 99, 5]), torch.tensor([0, 1, 3, 3, 4])).shape
    torch.Size([2, 2, 8])
    """

    def __init__(self, num_tables: int, num_embeddings: int, embedding_dim: int, tt_ranks,
                 tt_p_shapes=None, tt_q_shapes=None, optimizer: OptimType = OptimType.SGD,
                 learning_rate: float = 0.1, eps: float = 1.0e-10, sparse: bool = True,
                 use_cache: bool = False, cache_size: int = 0, hashtbl_size: int = 0,
                 weight_dist: str = "approx-normal", enforce_embedding_dim: bool = False, *,
                 mode: str = "sum", include_last_offset: bool = True, seed=None,
                 betas=(0.9, 0.999), weight_decay: float = 0.0, eta: float = 0.001,
                 momentum: float = 0.9, device=None, process_group="default"):
        super().__init__()
        # integers only, as torch's sizes: int(10.7) would build another table than asked
        # without a word
        num_tables, num_embeddings, embedding_dim, cache_size, hashtbl_size = (
            integral_size(name, value) for name, value in (
                ("num_tables", num_tables), ("num_embeddings", num_embeddings),
                ("embedding_dim", embedding_dim), ("cache_size", cache_size),
                ("hashtbl_size", hashtbl_size)))
        group = resolve_group(process_group)
        if num_tables <= 0 or num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"num_tables, num_embeddings and embedding_dim must be positive, "
                             f"got {num_tables}, {num_embeddings}, {embedding_dim}")
        if use_cache and num_tables != 1:
            raise ValueError(f"use_cache=True needs num_tables == 1 (as in FBTT), got "
                             f"{num_tables}")
        tt_ranks = integral_sizes("tt_ranks", tt_ranks)
        d = len(tt_ranks) + 1
        p = (compat.suggested_tt_shapes(num_embeddings, d) if tt_p_shapes is None
             else integral_sizes("tt_p_shapes", tt_p_shapes))
        # The width is factored exactly, whatever enforce_embedding_dim says. FBTT's flag only
        # lets its factorization round the width up (128 -> 200 = 5 x 5 x 8), and FBTT then
        # asserts prod(tt_q_shapes) == embedding_dim: it never returns another width, it fails.
        # So every call FBTT accepts gets the same q here, and the ones it rejects keep the
        # asked width instead of changing it (docs/tt.md, "The embedding width").
        q = (compat.suggested_tt_shapes(embedding_dim, d, allow_round_up=False)
             if tt_q_shapes is None else integral_sizes("tt_q_shapes", tt_q_shapes))
        self.shape = core.TTShape(p, q, tt_ranks)
        if self.shape.num_rows < num_embeddings:
            raise ValueError(f"prod(tt_p_shapes) = {self.shape.num_rows} < num_embeddings "
                             f"{num_embeddings}")
        if self.shape.dim != embedding_dim:  # only given q can differ (see above)
            raise ValueError(f"prod(tt_q_shapes) = {self.shape.dim} != embedding_dim "
                             f"{embedding_dim}")
        if not isinstance(optimizer, OptimType):
            raise ValueError(f"optimizer must be an OptimType ({[o.name for o in OptimType]}), "
                             f"got {optimizer!r}")
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        if not math.isfinite(learning_rate) or learning_rate < 0:
            raise ValueError(f"learning_rate must be a finite number >= 0, got {learning_rate!r}")
        if not math.isfinite(eps) or eps < 0:
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        self.num_tables, self.tt_ndim = int(num_tables), d
        self.num_embeddings, self.embedding_dim = int(num_embeddings), self.shape.dim
        self.tt_p_shapes, self.tt_q_shapes = list(self.shape.p_shapes), list(self.shape.q_shapes)
        self.tt_ranks = list(self.shape.padded_ranks)
        self.optimizer = optimizer
        self.sparse, self.mode, self.include_last_offset = sparse, mode, include_last_offset
        self._group = group
        # replicas draw the same cores: the ranks agree on the seed
        self._seed = seed if group is None else tt_dist.agree_seed(group, seed)
        self.use_cache = bool(use_cache)
        # FBTT's defaults: 10% of the rows, a frequency table of one slot per row.
        self.cache_size = (0 if not use_cache else int(cache_size) if cache_size > 0
                           else max(1, int(0.1 * self.num_embeddings)))
        self.hashtbl_size = (0 if not use_cache else int(hashtbl_size) if hashtbl_size > 0
                             else self.num_embeddings)
        # The training state is the core table's (cores, optimizer state, step counter, cache,
        # checks, scratch), drawn and allocated there; this module holds its arrays as
        # Parameters and buffers of FBTT's names and hands the table views of them.
        table = TTTable(self.shape, CORE_OPTIMIZER[optimizer], dict(
            lr=learning_rate, eps=eps, betas=betas, weight_decay=weight_decay, eta=eta,
            momentum=momentum), num_tables=self.num_tables, num_embeddings=self.num_embeddings,
            cache_size=self.cache_size, hashtbl_size=self.hashtbl_size, init=weight_dist,
            seed=self._seed)
        self._tt = table
        on = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        self.register_buffer("_step_counter", on(table.step_array), persistent=False)
        strides = [math.prod(self.tt_p_shapes[k + 1:]) for k in range(d)]
        self.register_buffer("L", torch.tensor(strides, dtype=torch.int64, device=device))
        self.tt_cores = torch.nn.ParameterList(
            [torch.nn.Parameter(on(c)) for c in table.tables_cores()])
        # Fused optimizer state: FBTT's optimizer_state<k> holds each core's first state
        # (empty for SGD); further states sit beside it as <name><k>.
        self.optimizer_state = _BufferList("optimizer_state")
        self._state_names = list(row_state(1, 1, self._core_optimizer))
        for k, state in enumerate(table.states):
            if not state:
                self.optimizer_state.append(torch.zeros(0, device=device))
            for j, (name, value) in enumerate(state.items()):
                t = on(value.reshape(self.num_tables, -1, *value.shape[1:]))
                if j == 0:
                    self.optimizer_state.append(t)
                else:
                    self.optimizer_state.register_buffer(f"{name}{k}", t)
        self._init_cache(table.cache, on, device)
        self._table()  # bound to this module's tensors from now on
        # On the GPU a fused training step never waits for its input check: a batch with an
        # index out of range or bad offsets changes nothing (the kernels skip it) and the
        # IndexError / ValueError is raised by the first call of the module after the GPU
        # finished that step (at the latest the third call after it), or by check_inputs().
        # False: every step waits for its check and raises at once.
        self.defer_input_check = True

    learning_rate = _hyper("lr", "The fused optimizer's learning rate.")
    eps = _hyper("eps", "The fused optimizer's eps.")
    betas = _hyper("betas", "The Adam / LAMB rules' betas.")
    weight_decay = _hyper("weight_decay", "The LAMB / LARS / Adam rules' weight decay.")
    eta = _hyper("eta", "LARS's eta.")
    momentum = _hyper("momentum", "LARS's momentum.")

    @property
    def defer_input_check(self) -> bool:
        """On the GPU, whether a fused step leaves its input check to a later call or
        :meth:`check_inputs` (True) or waits for it (False)."""
        return self.__dict__["_tt"].defer_checks

    @defer_input_check.setter
    def defer_input_check(self, value: bool) -> None:
        self.__dict__["_tt"].defer_checks = bool(value)

    @property
    def warmup(self) -> bool:
        """FBTT's warmup: True while the cache serves no lookup (until :meth:`cache_populate`).
        """
        if not self.use_cache:
            return self.__dict__.get("_warmup", True)
        return not self._table().cache_active

    @warmup.setter
    def warmup(self, value: bool) -> None:
        if not self.use_cache:
            self.__dict__["_warmup"] = bool(value)
            return
        self._table().cache_active = not value

    @property
    def _core_optimizer(self) -> str:
        return CORE_OPTIMIZER[self.optimizer]

    @property
    def iter(self) -> int:
        """Fused steps taken (the FBGEMM rules' global step; counted on the device, so
        replays of a captured step count as well; reading it waits for the device)."""
        with on_stream(self._step_counter):
            return self._table().step

    @iter.setter
    def iter(self, value: int) -> None:
        with on_stream(self._step_counter):
            self._table().step = int(value)

    def _init_cache(self, cache, on, device):
        if cache is None:
            self.register_buffer("hashtbl", torch.empty(0, dtype=torch.int64, device=device))
            self.register_buffer("cache_state", torch.empty(0, dtype=torch.int32, device=device))
            self.cache_weight = self.cache_optimizer_state = None
            return
        self.register_buffer("hashtbl", on(cache.freq_keys))
        self.register_buffer("cache_freq", on(cache.freq_counts))
        self.register_buffer("cache_state", on(cache.key_slots))
        self.register_buffer("cache_rows", on(cache.rows))
        # A Parameter trained by an outside optimizer when sparse=False (as FBTT's).
        self.cache_weight = torch.nn.Parameter(on(cache.weight), requires_grad=not self.sparse)
        if not self.sparse or not cache.state:
            self.cache_optimizer_state = None
        if self.sparse:
            for j, (name, value) in enumerate(cache.state.items()):
                self.register_buffer("cache_optimizer_state" if j == 0 else
                                     f"cache_optimizer_state_{name}", on(value))

    # ------------------------------------------------------------------ the core table

    def _tensors(self) -> list:
        """Every tensor the core table views: cores, optimizer state, step counter, cache."""
        tensors = list(self._cores()) + self._state_buffers() + [self._buffers["_step_counter"]]
        if self.use_cache:
            tensors += [self._parameters["cache_weight"]] + [
                self._buffers[attr] for attr in ("cache_rows", "hashtbl", "cache_freq",
                                                 "cache_state")] + [
                self._buffers[attr] for attr, _ in self._cache_spec()]
        return tensors

    def _table(self) -> TTTable:
        """The core table, bound to views of this module's tensors: bound again only when a
        tensor moved (``.to()``, a new ``.data``), so a step spends no host time on views."""
        # (pointer, device index, shape): a few attribute reads per tensor, no device object
        key = [(t.data_ptr(), t.get_device(), t.shape) for t in self._tensors()]
        if self.__dict__.get("_is_replica") and not self.__dict__.get("_own_table"):
            # an nn.DataParallel replica (a shallow copy of the module's __dict__): a table
            # of its own, so replicas running at once never bind one table to two devices
            self.__dict__["_tt"] = self.__dict__["_tt"].without_arrays()
            self.__dict__["_views"], self.__dict__["_own_table"] = {}, True
        views = self.__dict__.setdefault("_views", {})
        table = self.__dict__["_tt"]
        if views.get("bound") != key:
            table.bind(self._core_arrays(), self._state_arrays(),
                       array_of(self._buffers["_step_counter"]), self._cache_arrays())
            views["bound"] = key
        return table

    def _cache_spec(self) -> tuple:
        """(attribute, state name) of each cache state buffer (none without sparse=True)."""
        if not self.sparse:
            return ()
        return tuple(("cache_optimizer_state" if j == 0 else f"cache_optimizer_state_{name}",
                      name) for j, name in enumerate(self._state_names))

    def _cache_arrays(self):
        """The cache as a :class:`xferlib.tt.TTRowCache` over this module's tensors."""
        if not self.use_cache:
            return None
        buffers = self._buffers
        return core.TTRowCache.from_arrays(
            self.shape, self._core_optimizer, rows=array_of(buffers["cache_rows"]),
            weight=array_of(self._parameters["cache_weight"].data),
            state={name: array_of(buffers[attr]) for attr, name in self._cache_spec()},
            freq_keys=array_of(buffers["hashtbl"]), freq_counts=array_of(buffers["cache_freq"]),
            key_slots=array_of(buffers["cache_state"]), active=False)

    # ------------------------------------------------------------------ parameters

    def reset_parameters(self, weight_dist: str = "approx-normal") -> None:
        """Draw the cores again (FBTT's distributions; see ``xferlib.tt.init_tt_cores``), each
        table on its own. The fused optimizer's state and the cache are left as they are."""
        tables = draw_tt_tables(self.shape, self.num_tables, weight_dist, self.num_embeddings,
                                self._seed)
        with torch.no_grad():
            for c, drawn in zip(self.tt_cores, tables):
                c.copy_(torch.from_numpy(drawn))

    def get_params(self) -> list:
        """The cores, and the cache's dense rows with a cache (FBTT's list; FBTT appended the
        cache to its ``tt_cores`` on every call, this returns a new list)."""
        return list(self.tt_cores) + ([self.cache_weight] if self.use_cache else [])

    def set_learning_rate(self, lr: float) -> None:
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr!r}")
        self.learning_rate = float(lr)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .cpu(): the core table's views and working buffers belong to the
        # old storage (a view keeps its tensor alive): let go of them; the table binds the
        # new tensors at its next use.
        self.__dict__.pop("_views", None)
        self.__dict__["_tt"].unbind()
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        # Copies and pickles carry no views of this module's memory nor its buffers: the
        # copy's table binds the copy's tensors at its first use.
        state = self.__dict__.copy()
        state.pop("_views", None)
        state["_tt"] = self._tt.without_arrays()
        return state

    def _cores(self) -> tuple:
        """The core Parameters, read from the ParameterList's dict (its ``__iter__`` and
        ``__getitem__`` cost microseconds per core, at every step)."""
        return tuple(self._modules["tt_cores"]._parameters.values())

    def _core_arrays(self) -> list:
        """The cores as arrays of the joint TT (``[T p_k, width]`` views of the Parameters)."""
        return [array_of(c.detach().view(-1, c.shape[-1])) for c in self._cores()]

    def _state_buffers(self) -> list:
        buffers = self._modules["optimizer_state"]._buffers  # optimizer_state<k>, <name><k>
        return [buffers[f"optimizer_state{k}" if j == 0 else f"{name}{k}"]
                for k in range(self.tt_ndim) for j, name in enumerate(self._state_names)]

    def _state_arrays(self) -> list[dict]:
        """The fused optimizer's state per core as arrays of the joint TT."""
        buffers, names = iter(self._state_buffers()), self._state_names
        return [{name: array_of((buf := next(buffers)).view(-1, *buf.shape[2:]))
                 for name in names} for _ in range(self.tt_ndim)]

    # ------------------------------------------------------------------ forward

    def forward(self, indices, offsets, warmup=True, *, per_sample_weights=None):
        return self._bags(indices, offsets, warmup, per_sample_weights).view(
            self.num_tables, -1, self.embedding_dim)

    def _bags(self, indices, offsets, warmup, per_sample_weights):
        """The pooled bags of every table, ``(T * B, dim)`` (``forward`` views them per
        table; ``TTEmbeddingBag`` returns them as they are, with no view in the graph)."""
        if self._group is None or not (self.sparse and torch.is_grad_enabled() and any(
                c.requires_grad for c in self._cores())):
            return self._forward(indices, offsets, warmup, per_sample_weights)
        device = self.tt_cores[0].device
        if device.type == "cuda" and stream_capturing():
            raise RuntimeError("a fused TT step with a process group cannot be captured in a "
                               "CUDA graph; capture it with process_group=None")
        if self._device_checked():  # the backward's collective carries the device verdict
            return self._forward(indices, offsets, warmup, per_sample_weights)
        try:
            out = self._forward(indices, offsets, warmup, per_sample_weights)
        except (IndexError, ValueError, TypeError, RuntimeError) as err:
            tt_dist.agree_forward(self._group, device, err)  # raises on every rank
            raise
        tt_dist.agree_forward(self._group, device, None)
        return out

    def _device_checked(self) -> bool:
        """Whether training batches are checked on the device (the GPU kernel path)."""
        return self.tt_cores[0].device.type == "cuda" and self._table().checks_on_device()

    @property
    def process_group(self):
        """The group whose ranks train replicas of this module together (None: one
        process). See ``xferlib.adapters.torch.tt_dist``."""
        return self._group

    def broadcast_state(self, src: int = 0) -> None:
        """Copy the cores, optimizer state, step count and cache of the group's rank ``src``
        to every rank (e.g. after loading a checkpoint on one rank); nothing without a
        group. Every rank of the group calls it."""
        if self._group is None:
            return
        self._resolve_pending_check()
        tt_dist.broadcast_state(self, self._group, src)

    def _forward(self, indices, offsets, warmup, per_sample_weights):
        if isinstance(warmup, torch.Tensor):  # xferlib's earlier third argument
            per_sample_weights, warmup = warmup, True
        cores = self._cores()
        device = cores[0].device
        for name, t in (("indices", indices), ("offsets", offsets),
                        ("per_sample_weights", per_sample_weights)):
            if t is not None and t.device != device:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two "
                    f"devices, {device} and {t.device}! ({name} is on {t.device}, the TT "
                    f"cores on {device}: move the module or the inputs with .to())")
        for name, t in (("indices", indices), ("offsets", offsets)):
            # torch's bags take int32 and int64 only; uint8 in particular once meant a mask
            # in torch indexing, and a narrow type cannot address most tables' rows
            if t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name} must be an integer tensor of dtype int32 or int64 "
                                f"(as torch's EmbeddingBag takes), got {t.dtype}")
        if per_sample_weights is not None and per_sample_weights.requires_grad \
                and torch.is_grad_enabled():  # said, not dropped in silence
            raise NotImplementedError("the TT bags compute no gradient for "
                                      "per_sample_weights; pass per_sample_weights.detach()")
        if indices.dtype != torch.int64:
            indices = indices.long()
        if offsets.dtype != torch.int64:
            offsets = offsets.long()
        training = torch.is_grad_enabled() and (
            any(c.requires_grad for c in cores) or self.cache_weight is not None
            and self.cache_weight.requires_grad)
        return _TTBagFunction.apply(self, training, indices, offsets, per_sample_weights,
                                    self.cache_weight, *cores)

    def _resolve_pending_check(self, wait: bool = True) -> None:
        """Raise for a bad batch among the finished GPU steps (all of them with ``wait``)."""
        self._table().checks.poll(wait)

    def check_inputs(self) -> None:
        """Raise now for a bad batch of the GPU training steps so far, if there was one (that
        step changed nothing); a later call of the module would raise it anyway. A step
        captured in a CUDA graph checks its input at every replay the same way (a bad batch
        changes nothing) but reports it only here: call it after replays to read the last
        replay's verdict."""
        self._table().check()

    def full_weight(self) -> torch.Tensor:
        """The dense ``(prod(p), embedding_dim)`` table the forward reads (one table only, as
        in FBTT): differentiable in the cores, with the cached rows' dense values where the
        cache serves lookups."""
        if self.num_tables != 1:
            raise ValueError("full_weight() needs num_tables == 1 (as in FBTT)")
        self._resolve_pending_check()
        full = compat.tt_matrix_to_full(self.tt_p_shapes, self.tt_q_shapes, self.tt_ranks,
                                        list(self.tt_cores), [1, 0, 2, 3])
        if self.use_cache and not self.warmup:
            used = self.cache_rows != core.NO_ROW
            full = full.index_copy(0, self.cache_rows[used], self.cache_weight[used])
        return full

    from xferlib.adapters.torch.tt_cache import (  # noqa: E402  (the cache's methods)
        require_cache as _require_cache, reset_cache, update_cache,
        save_to_state_dict as _save_to_state_dict,
        load_from_state_dict as _load_from_state_dict)
    from xferlib.adapters.torch.tt_cache import cache_populate as _cache_populate  # noqa: E402

    @torch.no_grad()
    def cache_populate(self) -> None:
        """Fill the cache with the ``cache_size`` most frequently looked-up rows and end the
        warmup (lookups of cached rows read them from now on). Rows that stay keep their
        trained dense values and optimizer state; new rows start from the cores. The cores keep
        learning every row (write-through, see ``xferlib.tt.TTRowCache``), so rows that leave
        lose nothing the cores were taught. With a process group the counts of every rank are
        summed and every rank caches the same rows (every rank calls it)."""
        if self._group is None:
            return self._cache_populate()
        self._require_cache()
        tt_dist.populate_across(self, self._group, self._table(), on_stream)
