"""TTTable: a TT-compressed embedding table and all of its training state, the twin of
:class:`xferlib.HostTable`.

A :class:`TTTable` owns the cores (FBTT-Embedding's layout), the fused sparse optimizer's
name, hyperparameters and state, the step counter of the FBGEMM rules, the optional row cache
(:class:`xferlib.tt.TTRowCache`), the queue of deferred input checks
(:class:`xferlib.batch.PendingChecks`) and the GPU steps' working buffers
(:class:`xferlib.tt.scratch.ScratchSet`). Training is two calls, as with a host table:

* :meth:`TTTable.lookup` pools the bags of a batch and returns what the update needs;
* :meth:`TTTable.apply_gradients` runs backward and the optimizer in one (the fused update of
  :func:`xferlib.tt.tt_fused_update`), counting the step.

``num_tables`` tables of one shape live in one set of cores: ``cores[k]`` is ``[T p_k,
width]``, the cores of one larger TT whose row with digits ``(t p_k + i_k)_k`` is row ``i`` of
table ``t`` (a lookup of every table runs as one batch). Arrays are NumPy (the CPU path) or
CuPy (the GPU path, the CUDA kernels where the shape fits them), allocated here or adopted
from a framework's tensors (:meth:`TTTable.from_arrays`, :meth:`TTTable.bind`): the torch
modules keep their Parameters and buffers and hand this table views of them.

>>> import numpy as np
>>> from xferlib.tt import TTShape, TTTable
>>> table = TTTable(TTShape([4, 5], [2, 2], [3]), "sgd", {"lr": 0.1}, seed=0)
>>> bags, residuals = table.lookup(np.array([1, 7, 7]), np.array([0, 1, 3]),
...                                include_last_offset=True)
>>> bags.shape
(2, 4)
>>> table.apply_gradients(residuals, np.ones((2, 4), np.float32))
>>> table.step
1
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np

from xferlib._backend import (array_module, as_cupy_stream, is_capturing, is_cupy_array,
                              stream_scope)
from xferlib.batch import PendingChecks
from xferlib.sizes import integral_size
from xferlib.tt.cache import TTRowCache, tt_cache_grad
from xferlib.tt.grads import tt_embedding_bag_bwd
from xferlib.tt.lookup import to_host, tt_bag_residuals, tt_embedding_bag_fwd, tt_rows
from xferlib.tt.plan import TTBagPlan, uses_kernels
from xferlib.tt.rules import SPARSE_OPTIMIZERS, state_layout, tt_sparse_state
from xferlib.tt.scratch import ScratchSet
from xferlib.tt.shape import TTShape, checked_indices, row_bound
from xferlib.tt.table_init import TT_HYPER_DEFAULTS, draw_tt_tables, resolve_tt_hyper
from xferlib.tt.update import tt_fused_update

__all__ = ["TTTable", "TTResiduals", "TT_HYPER_DEFAULTS", "draw_tt_tables"]


@dataclasses.dataclass(eq=False)
class TTResiduals:
    """What :meth:`TTTable.apply_gradients` needs from a :meth:`TTTable.lookup`: the core's
    residuals (``bag``: a :class:`xferlib.tt.TTBagPlan` on the kernel path, else ``(indices,
    bag of each lookup, weights)``), the cores and cache the lookup read, the number of bags
    and whether a CUDA graph was being captured."""

    bag: object
    cores: list
    cache: object
    num_bags: int
    captured: bool = False
    table: object = None  # the TTTable whose lookup made them


class TTTable:
    """A TT embedding table (``num_tables`` of one shape) with its fused optimizer.

    Args:
      shape: one table's :class:`xferlib.tt.TTShape`.
      optimizer: one of :data:`xferlib.tt.SPARSE_OPTIMIZERS`, run by :meth:`apply_gradients`.
      optimizer_kwargs: ``lr``, ``eps``, ``betas``, ``weight_decay``, ``eta``, ``momentum``
        (defaults: :data:`TT_HYPER_DEFAULTS`); change them later with :meth:`set_hyper`.
      num_tables: tables of this shape in the one set of cores.
      num_embeddings: rows of each table (indices must be below it; default ``prod(p)``).
      cache_size: rows of the dense row cache (one table only; 0: none); ``hashtbl_size``
        slots of its frequency table (default ``num_embeddings``).
      init: the cores' distribution (see :func:`xferlib.tt.init_tt_cores`), drawn from
        ``seed`` table after table.
      xp: ``numpy`` or ``cupy``, where the arrays live.

    Bad input raises before any state changes (TypeError for dtypes, IndexError for indices
    out of range, ValueError for shapes and offsets); on the GPU a training lookup's check is
    read in :meth:`apply_gradients`, or deferred (:attr:`defer_checks`) to a later call or
    :meth:`check`, and the kernels of a rejected batch write nothing to the cores, state,
    cache or step counter.
    """

    def __init__(self, shape: TTShape, optimizer: str = "sgd", optimizer_kwargs=None, *,
                 num_tables: int = 1, num_embeddings=None, cache_size: int = 0,
                 hashtbl_size: int = 0, init: str = "approx-normal", seed=None, xp=np):
        self._configure(shape, optimizer, optimizer_kwargs, num_tables, num_embeddings)
        cache_size = integral_size("cache_size", cache_size)
        hashtbl_size = integral_size("hashtbl_size", hashtbl_size)
        if cache_size < 0 or hashtbl_size < 0:
            raise ValueError(f"cache_size and hashtbl_size must be >= 0, got {cache_size}, "
                             f"{hashtbl_size}")
        if cache_size and self.num_tables != 1:
            raise ValueError(f"a row cache needs num_tables == 1 (as in FBTT), got "
                             f"{self.num_tables}")
        cores = draw_tt_tables(shape, self.num_tables, init, self.num_embeddings, seed)
        cores = [xp.asarray(c.reshape(-1, c.shape[-1])) for c in cores]
        states = tt_sparse_state(self.joint_shape, self.optimizer, xp)
        cache = None
        if cache_size:
            cache = TTRowCache(shape, cache_size, hashtbl_size or self.num_embeddings,
                               self.optimizer, xp)
        self.bind(cores, states, xp.zeros(1, dtype=np.int64), cache)

    @classmethod
    def from_arrays(cls, shape: TTShape, cores, states, step, *, optimizer: str = "sgd",
                    optimizer_kwargs=None, num_tables: int = 1, num_embeddings=None,
                    cache=None) -> "TTTable":
        """A table over existing arrays (a framework's tensors seen as NumPy / CuPy arrays,
        written in place): ``cores`` the joint cores (``[T p_k, width]``), ``states`` the
        optimizer's state per core (as :func:`xferlib.tt.tt_sparse_state` of the joint shape
        makes it), ``step`` a one-element int64 counter, ``cache`` a
        :class:`xferlib.tt.TTRowCache` or None."""
        table = cls.__new__(cls)
        table._configure(shape, optimizer, optimizer_kwargs, num_tables, num_embeddings)
        table.bind(cores, states, step, cache)
        return table

    def _configure(self, shape, optimizer, optimizer_kwargs, num_tables, num_embeddings):
        if not isinstance(shape, TTShape):
            raise TypeError(f"shape must be an xferlib.tt.TTShape, got {type(shape).__name__}")
        if optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {SPARSE_OPTIMIZERS}, got {optimizer!r}")
        num_tables = integral_size("num_tables", num_tables)
        if num_tables <= 0:
            raise ValueError(f"num_tables must be positive, got {num_tables}")
        self.shape, self.num_tables, self.optimizer = shape, num_tables, optimizer
        self.num_embeddings = row_bound(shape, num_embeddings)
        self._hyper = resolve_tt_hyper(optimizer_kwargs)
        # All tables as one TT of T p_k rows per core (see the module docstring); with one
        # table the indices are checked against num_embeddings, with several the joint row
        # of an index outside its table is -1, which the joint TT rejects.
        self.joint_shape = TTShape([num_tables * p for p in shape.p_shapes], shape.q_shapes,
                                   shape.ranks)
        self._bound = self.num_embeddings if num_tables == 1 else self.joint_shape.num_rows
        self._strides = [math.prod(shape.p_shapes[k + 1:]) for k in range(shape.d)]
        self._joint_strides = [math.prod(self.joint_shape.p_shapes[k + 1:])
                               for k in range(shape.d)]
        # Steps whose input check is still on its way (xferlib.batch's policy): the host may
        # run two steps ahead of the device before it waits for the oldest.
        self.checks = PendingChecks(limit=3)
        self.scratch = ScratchSet()
        # On the GPU a fused step never waits for its input check: a bad batch changes
        # nothing and raises from a later call or check(). False: every step waits.
        self.defer_checks = True
        self.cores = self.states = self.step_array = self.cache = None
        self._kernels = None

    # ------------------------------------------------------------------ arrays

    def bind(self, cores, states, step, cache=None) -> None:
        """Use these arrays from now on (e.g. a framework module's tensors after they moved):
        checked first, then swapped in. The hyperparameters, pending checks and the cache's
        warmup flag carry over; the working buffers of the old arrays are dropped."""
        cores, states = list(cores), [dict(s) for s in states]
        self.joint_shape.check_cores(cores)
        xp = array_module(cores[0])
        if len(states) != self.shape.d:
            raise ValueError(f"{self.shape.d} optimizer states expected, got {len(states)}")
        # float32 (the kernels' type); float64 runs the array path (a module's .double())
        floats = cores[0].dtype
        for k, (core, state) in enumerate(zip(cores, states)):
            if array_module(core) is not xp or core.dtype != floats or \
                    floats not in (np.float32, np.float64):
                raise TypeError(f"core {k} must be a float32 (or float64) array of the first "
                                f"core's namespace and dtype, got {type(core).__name__} "
                                f"{core.dtype}")
            for name, (want, dtype) in state_layout(*core.shape, self.optimizer,
                                                    floats).items():
                got = state.get(name)
                if got is None or tuple(got.shape) != want or got.dtype != dtype \
                        or array_module(got) is not xp:
                    raise ValueError(f"state {name!r} of core {k} must be {np.dtype(dtype)} "
                                     f"of shape {want} in the cores' namespace, got "
                                     f"{None if got is None else (got.dtype, got.shape)}")
        if tuple(step.shape) != (1,) or step.dtype != np.int64 or array_module(step) is not xp:
            raise ValueError(f"step must be a one-element int64 array beside the cores, got "
                             f"{step.dtype} {tuple(step.shape)}")
        if cache is not None:
            if self.num_tables != 1:
                raise ValueError("a row cache needs num_tables == 1 (as in FBTT)")
            if tuple(cache.weight.shape) != (cache.capacity, self.dim) or \
                    array_module(cache.weight) is not xp:
                raise ValueError(f"cache weight must be ({cache.capacity}, {self.dim}) beside "
                                 f"the cores, got {tuple(cache.weight.shape)}")
            if self.cache is not None:
                cache.active = self.cache.active
        self.cores, self.states, self.step_array, self.cache = cores, states, step, cache
        self.scratch.clear()
        self._kernels = None

    def unbind(self) -> None:
        """Let go of the arrays (and the working buffers) until the next :meth:`bind`: a
        framework module that moved keeps no view of its old storage alive. The
        hyperparameters, pending checks and the cache's warmup flag stay."""
        active = self.cache is not None and self.cache.active
        cache = None if self.cache is None else _Flag(active)
        self.cores = self.states = self.step_array = None
        self.cache, self._kernels = cache, None
        self.scratch.clear()

    def without_arrays(self) -> "TTTable":
        """A copy with this table's configuration, hyperparameters and cache flag but no
        arrays (until :meth:`bind`) and empty check queue and buffers: what a framework
        module's copy keeps before it binds its own tensors."""
        clone = copy.copy(self)
        active = self.cache is not None and self.cache.active
        clone.cores = clone.states = clone.step_array = clone._kernels = None
        clone.cache = None if self.cache is None else _Flag(active)
        clone.checks, clone.scratch = PendingChecks(limit=3), ScratchSet()
        clone._hyper = dict(self._hyper)
        return clone

    def __getstate__(self):
        state = self.__dict__.copy()
        state["scratch"] = ScratchSet()  # device buffers stay with this process's table
        return state

    @property
    def dim(self) -> int:
        return self.shape.dim

    @property
    def xp(self):
        """The array namespace of the cores (numpy or cupy)."""
        return array_module(self.cores[0])

    @property
    def on_gpu(self) -> bool:
        return is_cupy_array(self.cores[0])

    def tables_cores(self) -> list:
        """The cores in FBTT's stored layout, ``[num_tables, p_k, width]`` views."""
        return [c.reshape(self.num_tables, -1, c.shape[-1]) for c in self.cores]

    # ------------------------------------------------------------------ hyperparameters

    @property
    def hyper(self) -> dict:
        """The optimizer's hyperparameters (a copy; change them with :meth:`set_hyper`)."""
        return dict(self._hyper)

    def set_hyper(self, **changes) -> None:
        """Change hyperparameters (``lr`` from a schedule, say) for the following steps;
        checked before anything changes."""
        self._hyper = resolve_tt_hyper({**self._hyper, **changes})

    @property
    def step(self) -> int:
        """Fused steps taken (the FBGEMM rules' global step; on the GPU counted by the
        device, so replays of a captured step count too; reading it waits for the device)."""
        return int(to_host(self.step_array)[0])

    @step.setter
    def step(self, value: int) -> None:
        self.step_array[...] = integral_size("step", value)

    def rule_hyper(self) -> dict:
        """Every hyperparameter the fused rule takes, and its ``step``: the device counter
        itself on the GPU (read by the kernel), else its value (>= 1)."""
        h = self._hyper
        step = self.step_array if self.on_gpu else max(int(self.step_array[0]), 1)
        return dict(lr=h["lr"], eps=h["eps"], betas=h["betas"], weight_decay=h["weight_decay"],
                    eta=h["eta"], momentum=h["momentum"], step=step)

    # ------------------------------------------------------------------ lookup / update

    def lookup(self, indices, offsets, *, per_sample_weights=None, mode: str = "sum",
               include_last_offset: bool = False, train: bool = True, count_cache=None,
               stream=None, out=None):
        """The pooled bags ``(B, dim)`` (``(T * B, dim)`` for ``T`` tables, table ``t``'s bags
        at ``t B .. (t + 1) B - 1``), float32, and the :class:`TTResiduals` of the batch.

        ``indices`` (int32 / int64, each below ``num_embeddings``) and ``offsets`` (``B + 1``
        bounds with ``include_last_offset``, else ``B`` starts) in the cores' namespace;
        ``per_sample_weights`` one float per index; ``mode`` ``"sum"`` or ``"mean"``.
        ``train``: the batch will be trained (:meth:`apply_gradients`): on the GPU its input
        check is read there (the forward never waits for the device) and the cache counts
        its lookups (``count_cache``, default ``train``). ``out``: a ``(B, dim)`` float32
        array to write the bags into. ``stream``: where GPU work queues (default: CuPy's
        current stream)."""
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        self._check_inputs(indices, offsets, per_sample_weights)
        if out is not None:  # before the cache counts the batch
            bags = max(int(offsets.shape[0]) - (1 if include_last_offset else 0), 0)
            if array_module(out) is not self.xp or out.dtype != np.float32:
                raise TypeError(f"out must be a float32 {self.xp.__name__} array beside the "
                                f"cores, got {type(out).__name__} {out.dtype}")
            if tuple(out.shape) != (bags, self.dim):
                raise ValueError(f"out must have shape {(bags, self.dim)}, got "
                                 f"{tuple(out.shape)}")
        gpu = self.on_gpu
        stream = as_cupy_stream(stream) if gpu else None
        capturing = gpu and is_capturing(stream)
        if not capturing:  # a poll may wait on an event: never inside a capture
            self.checks.poll()
        report = None
        cache = self.cache
        count = cache is not None and bool(train if count_cache is None else count_cache)
        # working buffers reused from step to step (none in a capture: the graph keeps them)
        scratch = self.scratch.get(stream) if gpu and not capturing else None
        cores = self.cores
        with stream_scope(stream, gpu):  # every GPU op on the caller's stream, the array path's too
            if self.num_tables > 1:
                report = indices
                indices = self.joint_rows(indices, offsets, include_last_offset)
            bags, residuals = tt_embedding_bag_fwd(
                cores, self.joint_shape, indices, offsets, mode=mode,
                per_sample_weights=per_sample_weights,
                include_last_offset=include_last_offset, check=not train,
                num_embeddings=self._bound, out=out, cache=cache, cache_count=count,
                report=report if gpu else None, stream=stream, scratch=scratch)
        if isinstance(residuals, TTBagPlan):
            residuals.set_bound(self.num_embeddings)
        return bags, TTResiduals(residuals, cores, cache, int(bags.shape[0]), capturing, self)

    def residuals(self, indices, offsets, *, per_sample_weights=None, mode: str = "sum",
                  include_last_offset: bool = False, stream=None) -> TTResiduals:
        """The :class:`TTResiduals` of a batch without keeping its bags, checked at once:
        for callers that cannot carry a lookup's residuals to the update (a JAX update
        callback). The cache's access counts are left as they are. On the GPU kernel path
        with an active cache the forward runs again (its plan finds the cached rows)."""
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        self._check_inputs(indices, offsets, per_sample_weights)
        gpu = self.on_gpu
        stream = as_cupy_stream(stream) if gpu else None
        if gpu and (self.cache is not None and self.cache.active or self.num_tables > 1):
            return self.lookup(indices, offsets, per_sample_weights=per_sample_weights,
                               mode=mode, include_last_offset=include_last_offset,
                               train=False, count_cache=False, stream=stream)[1]
        with stream_scope(stream, gpu):
            if self.num_tables > 1:
                indices = self.joint_rows(indices, offsets, include_last_offset)
            res = tt_bag_residuals(self.joint_shape, indices, offsets, mode=mode,
                                   per_sample_weights=per_sample_weights,
                                   include_last_offset=include_last_offset,
                                   num_embeddings=self._bound)
        if isinstance(res, TTBagPlan):
            res.set_bound(self.num_embeddings)
            return TTResiduals(res, self.cores, self.cache, res.num_bags, table=self)
        return TTResiduals(res[:3], self.cores, self.cache, res[3], table=self)

    def apply_gradients(self, residuals: TTResiduals, grad_bags, *, stream=None,
                        reduce=None) -> None:
        """Backward and the optimizer in one (:func:`xferlib.tt.tt_fused_update`): every core
        row the batch touched (and with an active cache its hit rows) takes one step from
        ``grad_bags`` (``(B, dim)``, the gradient of :meth:`lookup`'s bags); the step counter
        counts it. On the GPU the lookup's input check is read here before anything is
        written, or deferred (:attr:`defer_checks`; a rejected batch's kernels write nothing).

        ``reduce``: the data-parallel hook, ``reduce(table, residuals, grad_bags)``, which
        sums the core-row gradients over processes and applies them (e.g. the torch
        adapter's ``tt_dist.fused_step``); it may return a verdict to defer (read at the
        same call on every process)."""
        self._check_grads(residuals, grad_bags)
        gpu = self.on_gpu
        stream = as_cupy_stream(stream) if gpu else None
        if reduce is not None:
            with stream_scope(stream, gpu):
                self.step_array += 1
            pending = reduce(self, residuals, grad_bags)
            if pending is not None:
                pending.defer(self.checks, stream, early=False)
            return
        with stream_scope(stream, gpu):  # every GPU op on the caller's stream, the array path's too
            self._fused_update(residuals, grad_bags, gpu, stream)

    def _fused_update(self, residuals, grad_bags, gpu, stream) -> None:
        if not gpu:
            self.step_array[0] += 1
        hyper = self.rule_hyper()
        # on the GPU the device counter, incremented by the step's gradient kernel (replays
        # count too): no launch of its own
        count = hyper["step"] if gpu else None
        capturing = gpu and (residuals.captured or is_capturing(stream))
        # deferred: read by a later call or check(); a captured step's verdict is written by
        # every replay and read by check()
        defer = residuals.captured or self.defer_checks
        scratch = self.scratch.get(stream) if gpu and not capturing else None
        tt_fused_update(residuals.cores, self.joint_shape, residuals.bag, grad_bags,
                        self.states, self.optimizer, cache=residuals.cache,
                        checks=self.checks if defer else None, stream=stream, scratch=scratch,
                        count=count, **hyper)

    def uncount(self, refused) -> None:
        """Take a counted step back where ``refused`` (an int64 0 or 1 beside the counter,
        e.g. a caller's own device-side verdict) is 1: no host sync, so a caller whose
        check refused a batch after the GPU step counted it leaves the counter as it was."""
        self.step_array -= refused

    def grads(self, residuals: TTResiduals, grad_bags, *, stream=None):
        """``(core gradients, cache gradient or None)`` of a lookup, for training the cores
        (and an active cache's dense rows) with an outside optimizer; nothing changes."""
        self._check_grads(residuals, grad_bags)
        stream = as_cupy_stream(stream) if self.on_gpu else None
        cache = residuals.cache
        cache_grad = None
        with stream_scope(stream, self.on_gpu):
            grads = tt_embedding_bag_bwd(residuals.cores, self.joint_shape, residuals.bag,
                                         grad_bags, stream=stream)
            if cache is not None and cache.active:
                cache_grad = tt_cache_grad(cache, self.joint_shape, residuals.bag,
                                           grad_bags)[0]
        return grads, cache_grad

    def check(self) -> None:
        """Raise now for a bad batch among the GPU steps so far (that step changed nothing);
        a step captured in a CUDA graph reports its last replay's verdict here."""
        self.checks.poll(wait=True)

    def checks_on_device(self) -> bool:
        """Whether training batches are checked on the device (the GPU kernel path)."""
        if self._kernels is None:  # the step counter: an int64 array beside the cores
            self._kernels = uses_kernels(self.joint_shape, self.step_array, self.cores)
        return self._kernels

    # ------------------------------------------------------------------ joint rows

    def joint_rows(self, indices, offsets, include_last_offset: bool = False):
        """Each lookup's row in the joint TT (digits ``t p_k + i_k``; no host sync on the
        GPU); an index outside its table maps to -1, which the joint TT rejects (NumPy
        indices raise IndexError at once, naming the index)."""
        xp = array_module(indices)
        bags = offsets.shape[0] - (1 if include_last_offset else 0)
        T = self.num_tables
        if bags % T:
            raise ValueError(f"offsets must hold num_tables * B bags (+1), got {bags} bags for "
                             f"{T} tables")
        indices = indices.astype(np.int64, copy=False)
        if xp is np:  # raises for the first index out of range
            checked_indices(indices, self.shape, self.num_embeddings)
        valid = (indices >= 0) & (indices < self.num_embeddings)
        per_table = max(bags // T, 1)
        # Each lookup's bag: the bag ends (or, without the last offset, the next bags'
        # starts) at or before it; the first bag's start, 0, is never one of them.
        bounds = xp.ascontiguousarray(offsets[1:])
        bag = xp.searchsorted(bounds, xp.arange(indices.shape[0]), side="right")
        table = xp.minimum(bag // per_table, T - 1)
        joint = self._joint_of(table, indices)
        return xp.where(valid, joint, -1)

    def _joint_of(self, table, indices):
        joint = 0
        for k, p in enumerate(self.shape.p_shapes):
            digit = (indices // self._strides[k]) % p
            joint = joint + (table * p + digit) * self._joint_strides[k]
        return joint

    # ------------------------------------------------------------------ dense views

    def full_weight(self, table=None):
        """The dense rows the lookups read, ``(prod(p), dim)`` float32 in the cores'
        namespace (the cache's dense rows where it serves lookups): table ``table``, or
        with None the one table (all of them, ``(T, prod(p), dim)``, for several)."""
        self.check()
        xp = self.xp
        rows = xp.arange(self.shape.num_rows, dtype=np.int64)
        which = range(self.num_tables) if table is None else [table]
        for t in which:
            if not 0 <= int(t) < self.num_tables:
                raise IndexError(f"table {t} out of range for {self.num_tables} tables")
        dense = [tt_rows(self.cores, self.joint_shape, self._joint_of(int(t), rows))
                 for t in which]
        if self.cache is not None and self.cache.active:
            self.cache.overlay(dense[0])
        return dense[0] if len(dense) == 1 else xp.stack(dense)

    def numpy(self, table=None) -> np.ndarray:
        """:meth:`full_weight` as a NumPy array."""
        return to_host(self.full_weight(table))

    # ------------------------------------------------------------------ row cache

    def _require_cache(self) -> TTRowCache:
        if self.cache is None:
            raise RuntimeError("this TT table has no row cache (cache_size=0)")
        return self.cache

    @property
    def cache_active(self) -> bool:
        """Whether the cache serves lookups (False during FBTT's warmup, until
        :meth:`populate_cache`; always False without a cache)."""
        return self.cache is not None and self.cache.active

    @cache_active.setter
    def cache_active(self, value: bool) -> None:
        self._require_cache().active = bool(value)

    def count_cache(self, indices, *, stream=None) -> None:
        """Add the lookups of ``indices`` to the cache's access counts (training lookups do
        it; the cached rows change only at :meth:`populate_cache`)."""
        cache = self._require_cache()
        xp = self.xp
        with stream_scope(stream, self.on_gpu):
            indices = xp.asarray(indices)
            if indices.dtype.kind not in "iu":  # a cast would count other rows in silence
                raise TypeError(f"indices must be integers, got {indices.dtype}")
            indices = indices.astype(np.int64, copy=False).reshape(-1)
            bad = (indices < 0) | (indices >= self.num_embeddings)
            if bool(bad.any()):
                position = int(xp.flatnonzero(bad)[0])
                raise IndexError(f"index {int(indices[position])} at position {position} is "
                                 f"out of range for {self.num_embeddings} embeddings")
            cache.count(indices, stream=stream)

    def populate_cache(self) -> None:
        """Cache the ``cache_size`` most frequently looked-up rows and end the warmup (see
        :meth:`xferlib.tt.TTRowCache.populate`): rows that stay keep their dense values and
        state, new rows start from the cores, which keep learning every row."""
        cache = self._require_cache()
        self.check()
        cache.populate(self.cores)

    def populate_cache_from(self, keys, counts) -> None:
        """:meth:`populate_cache` from given access counts (host arrays of row ids and their
        counts, e.g. those of several processes summed)."""
        cache = self._require_cache()
        self.check()
        cache.populate_from(self.cores, keys, counts)

    def reset_cache(self) -> None:
        """Empty the cache and its access counts; every row reads the cores again."""
        self._require_cache().reset()

    # ------------------------------------------------------------------ checks

    def _check_inputs(self, indices, offsets, weights) -> None:
        if self.cores is None:
            raise RuntimeError("this TT table has no arrays bound (bind() them first)")
        xp = self.xp
        for name, a in (("indices", indices), ("offsets", offsets)):
            if array_module(a) is not xp:
                raise TypeError(f"{name} must be a {xp.__name__} array like the cores, got "
                                f"{type(a).__name__}")
            if a.dtype not in (np.int32, np.int64):
                raise TypeError(f"{name} must be int32 or int64, got {a.dtype}")
            if a.ndim != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(a.shape)}")
        if weights is not None:
            if array_module(weights) is not xp:
                raise TypeError(f"per_sample_weights must be a {xp.__name__} array like the "
                                f"cores, got {type(weights).__name__}")
            if weights.dtype.kind != "f":
                raise TypeError(f"per_sample_weights must be floating point, got "
                                f"{weights.dtype}")

    def _check_grads(self, residuals, grad_bags) -> None:
        if not isinstance(residuals, TTResiduals):
            raise TypeError(f"residuals must be the TTResiduals of a lookup, got "
                            f"{type(residuals).__name__}")
        if residuals.table is not self or residuals.cores is not self.cores:
            raise ValueError("residuals must come from a lookup of this table with its "
                             "current arrays (another table's lookup, or one made before "
                             "the table was bound to other arrays)")
        if array_module(grad_bags) is not self.xp:
            raise TypeError(f"grad_bags must be a {self.xp.__name__} array like the cores, "
                            f"got {type(grad_bags).__name__}")
        if grad_bags.dtype.kind != "f":
            raise TypeError(f"grad_bags must be floating point, got {grad_bags.dtype}")
        want = (residuals.num_bags, self.dim)
        if tuple(grad_bags.shape) != want:
            raise ValueError(f"grad_bags must have shape {want}, got {tuple(grad_bags.shape)}")

    def __repr__(self) -> str:
        return (f"TTTable(p={list(self.shape.p_shapes)}, q={list(self.shape.q_shapes)}, "
                f"ranks={list(self.shape.ranks)}, num_tables={self.num_tables}, "
                f"optimizer={self.optimizer!r}, cache_size="
                f"{0 if self.cache is None else getattr(self.cache, 'capacity', 0)})")


class _Flag:
    """An unbound table's cache: only its warmup flag (what :meth:`TTTable.bind` carries)."""

    __slots__ = ("active",)

    def __init__(self, active: bool):
        self.active = active


