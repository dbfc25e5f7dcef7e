"""HostTable: an embedding table and its optimizer state in pinned host RAM.

Each step moves only the rows a batch touches: :meth:`HostTable.lookup` brings their weights
to the GPU (or returns them as NumPy on a CPU machine) and :meth:`HostTable.apply_gradients`
sums the gradients of repeated indices and runs a fused sparse optimizer on the touched rows
where they live. A GPU cache of hot rows (``cache_rows``) serves them from HBM, and
:meth:`HostTable.prefetch` moves the next batch's rows on a side stream.

Row layout
----------
One row of the table's storage holds the row's weights, then (on a 16-byte boundary) its
optimizer state: the rule's full-width slots (``dim`` values each, e.g. Adam's ``exp_avg`` and
``exp_avg_sq``), the rule's per-row scalars (row-wise Adagrad's ``sum``), and the row's step
count as an 8-byte-aligned int64 at the end; rows are padded to 16 bytes, so the kernels move
whole 16-byte words. So one sorted fetch brings a row's weights and state
together. A table built on a user's NumPy array (``init=array``) keeps the weights in that
array, pinned in place, and the state in a second pinned array.

Lazy semantics
--------------
The optimizers apply torch.optim's formulas, names and defaults to the rows present in the
batch only: a row that is not looked up keeps its weights and state (no weight decay, no
momentum), and bias corrections use the row's own step count (how often the row was
updated), as FBGEMM's and TensorFlow's lazy sparse optimizers do. A row updated every step
follows ``torch.optim`` exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Callable

import numpy as np

from xferlib._backend import as_cupy_stream, cupy_available, is_cupy_array
from xferlib.memory import device_pointer, is_pinned, pin, pinned_empty
from xferlib.optim import _check_common
from xferlib.rows import (_check_host_indices, _check_index_dtype, _raise_if_bad,
                          _sorted_positions, _take_rows, _to_gpu_indices)

__all__ = ["HostTable", "SPARSE_OPTIMIZERS", "sparse_update_reference", "optimizer_defaults"]

_FORMAT = "xferlib.HostTable/1"


# ----------------------------------------------------------------------------- rules
# Each rule updates the rows of a batch in place: w (rows x dim), the state slots (same
# shape), row scalars (rows,), g the summed gradients and t the rows' step counts after this
# step (rows x 1), all in the table's dtype. These NumPy functions are the NumPy path, and
# run in float64 they are the reference (`sparse_update_reference`).


def _signed(h, g):
    return -g if h["maximize"] else g


def _l2(h, w, g):
    return g + w.dtype.type(h["weight_decay"]) * w if h["weight_decay"] else g


def _sgd(h, w, s, r, g, t):
    f = w.dtype.type
    g = _l2(h, w, _signed(h, g))
    if h["momentum"]:
        buf = s["momentum_buffer"]
        buf[...] = np.where(t == 1, g, f(h["momentum"]) * buf + f(1.0 - h["dampening"]) * g)
        g = g + f(h["momentum"]) * buf if h["nesterov"] else buf
    w -= f(h["lr"]) * g


def _adam(h, w, s, r, g, t, decoupled=False):
    f = w.dtype.type
    b1, b2 = h["betas"]
    g = _signed(h, g)
    if h["weight_decay"]:
        if decoupled:
            w *= f(1.0 - h["lr"] * h["weight_decay"])
        else:
            g = g + f(h["weight_decay"]) * w
    m, v = s["exp_avg"], s["exp_avg_sq"]
    m += f(1.0 - b1) * (g - m)
    v *= f(b2)
    v += f(1.0 - b2) * g * g
    if h["amsgrad"]:
        np.maximum(s["max_exp_avg_sq"], v, out=s["max_exp_avg_sq"])
        v = s["max_exp_avg_sq"]
    step_size = (h["lr"] / (1.0 - b1 ** t.astype(np.float64))).astype(w.dtype)
    bc2_sqrt = np.sqrt(1.0 - b2 ** t.astype(np.float64)).astype(w.dtype)
    w -= step_size * (m / (np.sqrt(v) / bc2_sqrt + f(h["eps"])))


def _adamw(h, w, s, r, g, t):
    _adam(h, w, s, r, g, t, decoupled=True)


def _adagrad(h, w, s, r, g, t):
    f = w.dtype.type
    g = _l2(h, w, _signed(h, g))
    clr = (h["lr"] / (1.0 + (t - 1).astype(np.float64) * h["lr_decay"])).astype(w.dtype)
    total = s["sum"]
    total += g * g
    w -= clr * (g / (np.sqrt(total) + f(h["eps"])))


def _rowwise_adagrad(h, w, s, r, g, t):
    f = w.dtype.type
    g = _l2(h, w, _signed(h, g))
    total = r["sum"]
    total += np.mean(g * g, axis=1)
    w -= (f(h["lr"]) / (np.sqrt(total) + f(h["eps"])))[:, None] * g


def _adamax(h, w, s, r, g, t):
    f = w.dtype.type
    b1, b2 = h["betas"]
    g = _l2(h, w, _signed(h, g))
    m, u = s["exp_avg"], s["exp_inf"]
    m += f(1.0 - b1) * (g - m)
    np.maximum(u * f(b2), np.abs(g) + f(h["eps"]), out=u)
    w -= (h["lr"] / (1.0 - b1 ** t.astype(np.float64))).astype(w.dtype) * (m / u)


def _rmsprop(h, w, s, r, g, t):
    f = w.dtype.type
    alpha = h["alpha"]
    g = _l2(h, w, _signed(h, g))
    sq = s["square_avg"]
    sq *= f(alpha)
    sq += f(1.0 - alpha) * g * g
    if h["centered"]:
        ga = s["grad_avg"]
        ga += f(1.0 - alpha) * (g - ga)
        avg = np.sqrt(sq - ga * ga) + f(h["eps"])
    else:
        avg = np.sqrt(sq) + f(h["eps"])
    if h["momentum"] > 0:
        buf = s["momentum_buffer"]
        buf *= f(h["momentum"])
        buf += g / avg
        w -= f(h["lr"]) * buf
    else:
        w -= f(h["lr"]) * (g / avg)


def _adadelta(h, w, s, r, g, t):
    f = w.dtype.type
    rho, eps = f(h["rho"]), f(h["eps"])
    g = _l2(h, w, _signed(h, g))
    sq, acc = s["square_avg"], s["acc_delta"]
    sq *= rho
    sq += f(1.0 - h["rho"]) * g * g
    delta = np.sqrt(acc + eps) / np.sqrt(sq + eps) * g
    acc *= rho
    acc += f(1.0 - h["rho"]) * delta * delta
    w -= f(h["lr"]) * delta


def _check_sgd(h):
    _check_common(h)
    for key in ("momentum", "dampening"):
        if h[key] < 0:
            raise ValueError(f"Invalid {key} value: {h[key]}")
    if h["nesterov"] and (h["momentum"] <= 0 or h["dampening"] != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def _check_range(*keys, upper=None):
    def check(h):
        _check_common(h)
        for key in keys:
            if h[key] < 0 or (upper is not None and h[key] > upper):
                raise ValueError(f"Invalid {key} value: {h[key]}")
    return check


@dataclasses.dataclass(frozen=True)
class _SparseRule:
    kind: int  # the kernel's RULE
    defaults: dict
    slots: Callable  # hyper -> names of full-width state slots, in storage order
    row_scalars: tuple  # names of per-row scalar state
    initial: Callable  # hyper -> initial value of the state
    kernel_hyper: Callable  # hyper -> the doubles the kernel reads
    update: Callable
    check: Callable


def _zero(h):
    return 0.0


def _adam_rule(weight_decay: float, decoupled: bool, update) -> "_SparseRule":
    """Adam and AdamW share the kernel rule; AdamW decays the weight apart from the gradient
    (the kernel reads the flag) and defaults to weight_decay=1e-2, as torch's."""
    return _SparseRule(
        1, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay,
                amsgrad=False, maximize=False),
        lambda h: ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if h["amsgrad"] else []),
        (), _zero,
        lambda h: [h["lr"], *h["betas"], h["eps"], h["weight_decay"], float(decoupled),
                   h["amsgrad"], h["maximize"]],
        update, _check_common)


_RULES = {
    "sgd": _SparseRule(
        0, dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                maximize=False),
        lambda h: ["momentum_buffer"] if h["momentum"] else [], (), _zero,
        lambda h: [h["lr"], h["momentum"], h["dampening"], h["weight_decay"], h["nesterov"],
                   h["maximize"]],
        _sgd, _check_sgd),
    "adam": _adam_rule(weight_decay=0.0, decoupled=False, update=_adam),
    "adamw": _adam_rule(weight_decay=1e-2, decoupled=True, update=_adamw),
    "adagrad": _SparseRule(
        2, dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
                eps=1e-10, maximize=False),
        lambda h: ["sum"], (), lambda h: h["initial_accumulator_value"],
        lambda h: [h["lr"], h["lr_decay"], h["weight_decay"], h["eps"], h["maximize"]],
        _adagrad, _check_range("lr_decay", "initial_accumulator_value")),
    # FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row, fed the mean squared gradient.
    "rowwise_adagrad": _SparseRule(
        3, dict(lr=1e-2, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-8,
                maximize=False),
        lambda h: [], ("sum",), lambda h: h["initial_accumulator_value"],
        lambda h: [h["lr"], h["weight_decay"], h["eps"], h["maximize"]],
        _rowwise_adagrad, _check_range("initial_accumulator_value")),
    "adamax": _SparseRule(
        4, dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False),
        lambda h: ["exp_avg", "exp_inf"], (), _zero,
        lambda h: [h["lr"], *h["betas"], h["eps"], h["weight_decay"], h["maximize"]],
        _adamax, _check_common),
    "rmsprop": _SparseRule(
        5, dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
                maximize=False),
        lambda h: (["square_avg"] + (["momentum_buffer"] if h["momentum"] > 0 else [])
                   + (["grad_avg"] if h["centered"] else [])), (), _zero,
        lambda h: [h["lr"], h["alpha"], h["eps"], h["weight_decay"], h["momentum"],
                   h["centered"], h["maximize"]],
        _rmsprop, _check_range("momentum", "alpha")),
    "adadelta": _SparseRule(
        6, dict(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, maximize=False),
        lambda h: ["square_avg", "acc_delta"], (), _zero,
        lambda h: [h["lr"], h["rho"], h["eps"], h["weight_decay"], h["maximize"]],
        _adadelta, _check_range("rho", upper=1.0)),
}

SPARSE_OPTIMIZERS = tuple(_RULES)


def optimizer_defaults(name: str) -> dict:
    """The hyperparameters and defaults of sparse optimizer ``name`` (torch.optim's)."""
    return dict(_rule(name).defaults)


def _rule(name: str) -> _SparseRule:
    try:
        return _RULES[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; one of {SPARSE_OPTIMIZERS} "
                         f"(or None for lookups only)") from None


def _resolve_hyper(name: str, overrides) -> dict:
    rule = _rule(name)
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(rule.defaults))
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {unknown} for {name!r}; "
                         f"known: {sorted(rule.defaults)}")
    h = {**rule.defaults, **overrides}
    if "betas" in h:
        h["betas"] = tuple(float(b) for b in h["betas"])
        if len(h["betas"]) != 2:
            raise ValueError(f"betas must be a pair, got {h['betas']}")
    rule.check(h)
    return h


# ----------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class _RowLayout:
    """Where each part of a row sits, in units of the table's dtype."""

    dim: int
    itemsize: int
    slots: tuple
    row_scalars: tuple

    @property
    def state_offset(self) -> int:  # start of the state in an interleaved row
        return _align(self.dim, self.itemsize, 16)

    @property
    def step_offset(self) -> int:  # the int64 step count, relative to the state
        return _align(len(self.slots) * self.dim + len(self.row_scalars), self.itemsize, 8)

    @property
    def state_width(self) -> int:
        return _align(self.step_offset + 8 // self.itemsize, self.itemsize, 16)

    @property
    def row_width(self) -> int:
        return self.state_offset + self.state_width


def _align(units: int, itemsize: int, boundary: int) -> int:
    """``units`` rounded up so that ``units * itemsize`` is a multiple of ``boundary`` bytes
    (16: rows and their parts start on 16-byte words, so kernels move whole words)."""
    per_word = max(1, boundary // itemsize)
    return -(-units // per_word) * per_word


def _split_state(layout: _RowLayout, state):
    """Views of a (rows x state_width) block: slots, row scalars and the int64 steps."""
    dim = layout.dim
    slots = {name: state[:, k * dim:(k + 1) * dim] for k, name in enumerate(layout.slots)}
    base = len(layout.slots) * dim
    scalars = {name: state[:, base + k] for k, name in enumerate(layout.row_scalars)}
    step_bytes = slice(layout.step_offset * layout.itemsize,
                       layout.step_offset * layout.itemsize + 8)
    steps = state.view(np.uint8)[:, step_bytes].view(np.int64)[:, 0]
    return slots, scalars, steps


def _sum_duplicates(idx: np.ndarray, grads: np.ndarray):
    """Sorted unique rows and their summed gradients, accumulated in float64 in batch order
    (one ``bincount`` over (row, column) pairs: deterministic, and faster than a reduceat)."""
    rows, inverse = np.unique(idx, return_inverse=True)
    dim = grads.shape[1]
    cells = (inverse.reshape(-1, 1) * dim + np.arange(dim)).ravel()
    summed = np.bincount(cells, weights=np.asarray(grads, dtype=np.float64).ravel(),
                         minlength=rows.size * dim)
    return rows, summed.reshape(rows.size, dim).astype(grads.dtype, copy=False)


def sparse_update_reference(name: str, weights, state: dict, steps, idx, grads,
                            hyper: dict | None = None):
    """The sparse optimizer ``name`` in float64 on copies: the oracle for HostTable.

    ``weights`` (num_rows x dim), ``state`` (slot name -> num_rows x dim, row-scalar name ->
    num_rows), ``steps`` (num_rows,) ints; ``idx`` (n,) and ``grads`` (n x dim). Duplicate
    indices' gradients are summed; only the rows present are updated (lazy semantics).
    Returns ``(weights, state, steps)``.
    """
    rule = _rule(name)
    h = _resolve_hyper(name, hyper)
    weights = np.array(weights, dtype=np.float64)
    state = {k: np.array(v, dtype=np.float64) for k, v in state.items()}
    steps = np.array(steps, dtype=np.int64)
    idx = np.asarray(idx).astype(np.int64)
    if idx.size == 0:
        return weights, state, steps
    rows, g = _sum_duplicates(idx, np.asarray(grads, dtype=np.float64))
    w = weights[rows]
    slots = {k: state[k][rows] for k in rule.slots(h)}
    scalars = {k: state[k][rows] for k in rule.row_scalars}
    t = (steps[rows] + 1)[:, None]
    rule.update(h, w, slots, scalars, g, t)
    weights[rows] = w
    for k, v in {**slots, **scalars}.items():
        state[k][rows] = v
    steps[rows] = t[:, 0]
    return weights, state, steps


# ----------------------------------------------------------------------------- the table


def _initial_weights(init, rng):
    """Parse ``init``: ``"zeros"``, ``("uniform", low, high)``, ``("normal", mean, std)``."""
    if isinstance(init, str):
        init = (init,)
    kind = init[0] if isinstance(init, tuple) and init else None
    if kind == "zeros" and len(init) == 1:
        return lambda out: out.fill(0)
    if kind in ("uniform", "normal") and len(init) == 3:
        a, b = float(init[1]), float(init[2])
        if kind == "uniform":
            if not a <= b:
                raise ValueError(f"uniform init needs low <= high, got ({a}, {b})")
            return lambda out: out.__setitem__(..., rng.uniform(a, b, out.shape))
        if b < 0:
            raise ValueError(f"normal init needs std >= 0, got {b}")
        return lambda out: out.__setitem__(..., rng.normal(a, b, out.shape))
    raise ValueError(f"init must be 'zeros', ('uniform', low, high), ('normal', mean, std) or "
                     f"a (num_rows, dim) NumPy array, got {init!r}")


_INIT_CHUNK_ROWS = 1 << 16


class HostTable:
    """An embedding table and its optimizer state in pinned host memory.

    Args:
      num_rows, dim: the table's shape.
      dtype: ``"float32"`` (the GPU path) or ``"float64"``.
      optimizer: one of :data:`SPARSE_OPTIMIZERS` (``"sgd"``, ``"adam"``, ``"adamw"``,
        ``"adagrad"``, ``"rowwise_adagrad"``, ``"adamax"``, ``"rmsprop"``, ``"adadelta"``),
        run by :meth:`apply_gradients`; None for a table that is only looked up and written.
      optimizer_kwargs: hyperparameters, with torch.optim's names and defaults
        (:func:`optimizer_defaults`); unknown names or invalid values raise ValueError.
      cache_rows: rows (with their state) kept in a GPU cache; 0: no cache.
      cache_policy: ``"lru"`` (evict the least recently used rows) or ``"lfu"`` (the least
        often used). Rows of the batch being looked up are never evicted by that batch.
      cache_admission: ``"second-sight"`` (default: a missed row enters the cache the second
        time a lookup misses it; rows seen once are served from host RAM) or ``"always"``.
      init: ``"zeros"``, ``("uniform", low, high)``, ``("normal", mean, std)`` (default
        ``("normal", 0, 1)``, as ``torch.nn.Embedding``), or a ``(num_rows, dim)`` C-contiguous
        NumPy array of the table's dtype, which is pinned in place and becomes the weights
        (no second copy).
      seed: for the random initializers.

    >>> import numpy as np, xferlib
    >>> table = xferlib.HostTable(1000, 4, optimizer="sgd", optimizer_kwargs={"lr": 0.5},
    ...                           init="zeros")
    >>> idx = np.array([3, 7, 3])
    >>> table.apply_gradients(idx, np.ones((3, 4), np.float32))
    >>> table.lookup(np.array([3, 7]))[:, 0].tolist()
    [-1.0, -0.5]
    """

    def __init__(self, num_rows: int, dim: int, dtype="float32", optimizer=None,
                 optimizer_kwargs=None, cache_rows: int = 0, init=("normal", 0.0, 1.0), *,
                 cache_policy: str = "lru", cache_admission: str = "second-sight", seed=None):
        num_rows, dim, cache_rows = int(num_rows), int(dim), int(cache_rows)
        if num_rows < 0 or dim < 1:
            raise ValueError(f"a table needs num_rows >= 0 and dim >= 1, got ({num_rows}, {dim})")
        dtype = np.dtype(dtype)
        if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"HostTable stores float32 or float64 rows, got dtype {dtype}")
        if cache_rows < 0:
            raise ValueError(f"cache_rows must be >= 0, got {cache_rows}")
        if cache_policy not in ("lru", "lfu"):
            raise ValueError(f"cache_policy must be 'lru' or 'lfu', got {cache_policy!r}")
        if cache_admission not in ("second-sight", "always"):
            raise ValueError(f"cache_admission must be 'second-sight' or 'always', got "
                             f"{cache_admission!r}")
        if optimizer is None:
            if optimizer_kwargs:
                raise ValueError("optimizer_kwargs given without an optimizer")
            self._rule, self._hyper = None, {}
        else:
            self._rule = _rule(optimizer)
            self._hyper = _resolve_hyper(optimizer, optimizer_kwargs)
        self.num_rows, self.dim, self.dtype = num_rows, dim, dtype
        self.optimizer = optimizer
        self.cache_rows = min(cache_rows, num_rows)
        self.cache_policy = cache_policy
        self.cache_admission = cache_admission
        self._layout = _RowLayout(dim, dtype.itemsize,
                                  tuple(self._rule.slots(self._hyper)) if self._rule else (),
                                  self._rule.row_scalars if self._rule else ())
        self._allocate(init, np.random.default_rng(seed))
        self._gpu = None  # device-side state (cache, hyper table, streams), made on first use

    # ------------------------------------------------------------------ storage

    def _allocate(self, init, rng) -> None:
        layout, shape = self._layout, (self.num_rows,)
        alloc = pinned_empty if cupy_available() else np.empty
        if isinstance(init, np.ndarray):
            if init.shape != (self.num_rows, self.dim) or init.dtype != self.dtype:
                raise ValueError(f"init array must have shape {(self.num_rows, self.dim)} and "
                                 f"dtype {self.dtype}, got {init.shape} {init.dtype}")
            if not init.flags.c_contiguous:
                raise ValueError("init array must be C-contiguous (it is used in place)")
            self._storage = None
            self._weights = pin(init) if cupy_available() else init
            self._state = alloc(shape + (layout.state_width,), self.dtype)
            fill_weights = None
        else:
            fill_weights = _initial_weights(init, rng)
            self._storage = alloc(shape + (layout.row_width,), self.dtype)
            self._weights = self._storage[:, :self.dim]
            self._state = self._storage[:, layout.state_offset:]
        initial = self._rule.initial(self._hyper) if self._rule else 0.0
        for start in range(0, self.num_rows, _INIT_CHUNK_ROWS):
            stop = min(start + _INIT_CHUNK_ROWS, self.num_rows)
            if fill_weights is not None:
                fill_weights(self._weights[start:stop])
            state = self._state[start:stop]
            state[...] = 0
            slots, scalars, steps = _split_state(layout, state)
            for view in (*slots.values(), *scalars.values()):
                view[...] = initial
            steps[...] = 0

    @property
    def hyper(self) -> dict:
        """The optimizer's hyperparameters (a copy; change them with :meth:`set_hyper`)."""
        return dict(self._hyper)

    def set_hyper(self, **changes) -> None:
        """Change hyperparameters (e.g. ``lr`` from a schedule) for the following steps.
        Hyperparameters that change the state layout (momentum on/off, amsgrad, centered)
        cannot change."""
        if self._rule is None:
            raise ValueError("this table has no optimizer")
        h = _resolve_hyper(self.optimizer, {**self._hyper, **changes})
        if tuple(self._rule.slots(h)) != self._layout.slots:
            raise ValueError(f"{sorted(changes)} would change the optimizer state layout "
                             f"{self._layout.slots}; build a new table")
        self._hyper = h
        if self._gpu is not None:
            self._gpu.hyper = None

    # ------------------------------------------------------------------ host views

    def numpy(self) -> np.ndarray:
        """The current weights, a read-only ``(num_rows, dim)`` view (GPU cache and queued
        GPU work flushed first)."""
        self._flush()
        view = self._weights.view(np.ndarray)
        view.flags.writeable = False
        return view

    def state(self, name: str) -> np.ndarray:
        """Optimizer state ``name`` as a read-only view: a slot (``num_rows x dim``), a row
        scalar (``num_rows``), or ``"step"`` (how often each row was updated)."""
        self._flush()
        slots, scalars, steps = _split_state(self._layout, self._state.view(np.ndarray))
        found = {**slots, **scalars, "step": steps}
        if name not in found:
            raise KeyError(f"no optimizer state {name!r}; this table has {sorted(found)}")
        view = found[name]
        view.flags.writeable = False
        return view

    def state_names(self) -> tuple:
        return (*self._layout.slots, *self._layout.row_scalars, "step")

    def restore(self, weights, state: dict) -> None:
        """Overwrite the weights (``(num_rows, dim)``) and every optimizer state array (the
        names of :meth:`state_names`, shaped as :meth:`state` returns them), e.g. from a
        checkpoint. Shapes are checked before anything is written; the GPU cache is written
        back and emptied first."""
        weights = np.asarray(weights)
        if weights.shape != (self.num_rows, self.dim):
            raise ValueError(f"weights must have shape {(self.num_rows, self.dim)}, got "
                             f"{weights.shape}")
        slots, scalars, steps = _split_state(self._layout, self._state.view(np.ndarray))
        views = {**slots, **scalars, "step": steps}
        missing = sorted(set(views) - set(state))
        if missing:
            raise ValueError(f"state is missing {missing}")
        for name, view in views.items():
            if np.shape(state[name]) != view.shape:
                raise ValueError(f"state {name!r} must have shape {view.shape}, got "
                                 f"{np.shape(state[name])}")
        self._flush(drop_cache=True)
        self._weights.view(np.ndarray)[...] = weights
        for name, view in views.items():
            view[...] = np.asarray(state[name])

    # ------------------------------------------------------------------ save / load

    def save(self, path) -> None:
        """Write weights, state and configuration to ``path`` (a ``.npz``), atomically: a
        crash leaves the old file or the new one, never a torn one."""
        self._flush()
        meta = dict(format=_FORMAT, num_rows=self.num_rows, dim=self.dim,
                    dtype=self.dtype.name, optimizer=self.optimizer, hyper=self._hyper,
                    cache_rows=self.cache_rows, cache_policy=self.cache_policy,
                    cache_admission=self.cache_admission,
                    slots=list(self._layout.slots), row_scalars=list(self._layout.row_scalars))
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".xferlib-", suffix=".npz.tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                         weights=self._weights.view(np.ndarray),
                         state=self._state.view(np.ndarray))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path, *, cache_rows=None) -> "HostTable":
        """A table saved by :meth:`save`. ValueError for a truncated or foreign file."""
        import zipfile

        path = os.fspath(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                if set(data.files) != {"meta", "weights", "state"}:
                    raise ValueError(f"{path} is not an xferlib HostTable file "
                                     f"(arrays {sorted(data.files)})")
                meta = json.loads(bytes(data["meta"]).decode())
                if meta.get("format") != _FORMAT:
                    raise ValueError(f"{path} is not an xferlib HostTable file "
                                     f"(format {meta.get('format')!r})")
                table = cls(meta["num_rows"], meta["dim"], meta["dtype"], meta["optimizer"],
                            meta["hyper"] or None,
                            meta["cache_rows"] if cache_rows is None else cache_rows,
                            init="zeros", cache_policy=meta["cache_policy"],
                            cache_admission=meta.get("cache_admission", "second-sight"))
                weights, state = data["weights"], data["state"]
                if (weights.shape != table._weights.shape
                        or state.shape != table._state.shape):
                    raise ValueError(f"{path}: array shapes {weights.shape}, {state.shape} do "
                                     f"not match its configuration")
                table._weights[...] = weights
                table._state[...] = state
        except (zipfile.BadZipFile, EOFError, OSError, KeyError,
                json.JSONDecodeError, UnicodeDecodeError) as err:
            if isinstance(err, FileNotFoundError):
                raise
            raise ValueError(f"{path} is truncated or not an xferlib HostTable file: "
                             f"{err}") from err
        return table

    # ------------------------------------------------------------------ lookup / update

    def lookup(self, idx, out=None, *, stream=None, return_batch: bool = False):
        """The weights of rows ``idx``: ``(len(idx), dim)``, on the GPU for CuPy indices (read
        from the cache or straight from pinned host RAM), as NumPy for NumPy indices.

        With a GPU cache, rows that missed are admitted (evicting rows not in this batch,
        which are written back first). Rows prefetched for this very ``idx`` object by
        :meth:`prefetch` are served from the prefetch buffer. ``return_batch=True`` returns
        ``(rows, batch)``: pass ``batch`` to :meth:`apply_gradients` instead of ``idx`` to
        reuse this lookup's checked, sorted indices."""
        _check_index_dtype(idx)
        if is_cupy_array(idx):
            rows, batch = self._gpu_state().lookup(idx, out, stream)
            return (rows, batch) if return_batch else rows
        self._flush(drop_cache=True)
        _check_host_indices(idx, self.num_rows)
        rows = _take_rows(self._weights.view(np.ndarray), idx, out)
        return (rows, idx) if return_batch else rows

    def apply_gradients(self, idx, grad_rows, *, stream=None) -> None:
        """Sum the gradients of repeated indices and run the table's optimizer on each touched
        row once, where the row lives. ``grad_rows``: ``(len(idx), dim)``, same namespace as
        ``idx``. Bad input raises before anything changes."""
        if self._rule is None:
            raise ValueError("this table has no optimizer; build it with optimizer=... or "
                             "write rows with scatter()")
        if isinstance(idx, _Plan):  # a batch from lookup(..., return_batch=True)
            if not is_cupy_array(grad_rows):
                raise TypeError("grad_rows must be a CuPy array for a GPU batch")
            if grad_rows.shape != (idx.n, self.dim):
                raise ValueError(f"grad_rows must have shape {(idx.n, self.dim)}, "
                                 f"got {grad_rows.shape}")
            self._gpu_state().apply(idx, grad_rows, stream)
            return
        _check_index_dtype(idx)
        self._check_grads(idx, grad_rows)
        if is_cupy_array(idx):
            if not is_cupy_array(grad_rows):
                raise TypeError("grad_rows must be a CuPy array like idx")
            self._gpu_state().apply(idx, grad_rows, stream)
            return
        if is_cupy_array(grad_rows):
            raise TypeError("grad_rows must be a NumPy array like idx")
        _check_host_indices(idx, self.num_rows)
        self._flush(drop_cache=True)
        if idx.size:
            self._update_numpy(idx, grad_rows)

    def _check_grads(self, idx, grads) -> None:
        if grads.ndim != 2 or grads.shape != (idx.shape[0], self.dim):
            raise ValueError(f"grad_rows must have shape {(idx.shape[0], self.dim)}, "
                             f"got {grads.shape}")
        if grads.dtype.kind != "f":
            raise TypeError(f"grad_rows must be floating point, got {grads.dtype}")

    def _update_numpy(self, idx, grads) -> None:
        rows, g = _sum_duplicates(np.asarray(idx), np.asarray(grads, dtype=self.dtype))
        weights = self._weights.view(np.ndarray)
        state = self._state.view(np.ndarray)
        w, s = weights[rows], state[rows]
        slots, scalars, steps = _split_state(self._layout, s)
        t = steps + 1
        self._rule.update(self._hyper, w, slots, scalars, g, t[:, None])
        steps[...] = t
        weights[rows] = w
        state[rows] = s

    def scatter(self, idx, rows, *, stream=None) -> None:
        """Overwrite the weights of rows ``idx`` (last write wins for repeats); the optimizer
        state is left as it is. CuPy ``idx`` and ``rows`` write straight to pinned memory."""
        from xferlib.rows import scatter_rows

        _check_index_dtype(idx)
        if rows.shape != (idx.shape[0], self.dim):
            raise ValueError(f"rows must have shape {(idx.shape[0], self.dim)}, got {rows.shape}")
        if is_cupy_array(idx) and is_cupy_array(rows):
            if self._gpu is not None and self._gpu.cache is not None:
                self._flush(drop_cache=True)
            gpu = self._gpu_state()
            stream = as_cupy_stream(stream)
            with stream:
                gpu._join_prefetch(stream)
                gpu.pending = None
                scatter_rows(self._weights, idx, rows.astype(self.dtype, copy=False),
                             stream=stream)
                gpu._record(stream)
            return
        if is_cupy_array(idx) or is_cupy_array(rows):
            idx = idx.get() if is_cupy_array(idx) else idx
            rows = rows.get() if is_cupy_array(rows) else rows
        _check_host_indices(idx, self.num_rows)
        self._flush(drop_cache=True)
        self._weights.view(np.ndarray)[idx] = np.asarray(rows, dtype=self.dtype)

    def prefetch(self, idx, *, stream=None) -> None:
        """Start moving rows ``idx`` (CuPy indices) to the GPU on a side stream; the next
        :meth:`lookup` of this same ``idx`` object uses them. Updates queued before the
        matching lookup are folded in (no stale rows), and nothing is written by a
        prefetch (no lost updates)."""
        _check_index_dtype(idx)
        if not is_cupy_array(idx):
            raise TypeError("prefetch takes CuPy indices (the GPU path)")
        self._gpu_state().prefetch(idx, stream)

    # ------------------------------------------------------------------ cache

    def cache_stats(self) -> dict:
        """Hit-rate statistics of the GPU cache since construction or the last reset:
        unique rows looked up, hits, misses, admitted and evicted rows, hit rate."""
        stats = dict(lookups=0, hits=0, misses=0, admitted=0, evicted=0)
        if self._gpu is not None:
            stats.update(self._gpu.stats)
        stats["hit_rate"] = stats["hits"] / stats["lookups"] if stats["lookups"] else 0.0
        return stats

    def reset_cache_stats(self) -> None:
        if self._gpu is not None:
            self._gpu.stats = dict.fromkeys(self._gpu.stats, 0)

    def flush(self) -> None:
        """Write every cached row back to host memory and wait for queued GPU work."""
        self._flush()

    def _flush(self, drop_cache: bool = False) -> None:
        if self._gpu is not None:
            self._gpu.flush(drop_cache)

    def _gpu_state(self) -> "_DeviceSide":
        if self._gpu is None:
            if not is_pinned(self._state.view(np.ndarray)):
                raise ValueError("this table's memory is not pinned (it was built without a "
                                 "GPU); the GPU path needs pinned memory")
            self._gpu = _DeviceSide(self)
        return self._gpu

    def __repr__(self) -> str:
        return (f"HostTable({self.num_rows}, {self.dim}, dtype={self.dtype.name!r}, "
                f"optimizer={self.optimizer!r}, cache_rows={self.cache_rows})")


# ----------------------------------------------------------------------------- GPU side


@dataclasses.dataclass
class _Plan:
    """A batch on the GPU: indices checked and sorted, runs of equal rows numbered."""

    idx: object
    keys: object
    perm: object
    run: object
    verdict: object

    @property
    def n(self) -> int:
        return int(self.keys.size)


def _high_priority_stream():
    """A non-blocking stream of the device's highest priority: when a prefetch overlaps
    compute, the block scheduler gives the prefetch's blocks the SMs that free up first.
    (CUDA clamps the requested priority into the device's range.)"""
    import cupy

    try:
        return cupy.cuda.Stream(non_blocking=True, priority=-(1 << 10))
    except TypeError:  # a CuPy without the priority argument
        return cupy.cuda.Stream(non_blocking=True)


class _DeviceSide:
    """The GPU half of a HostTable: kernels, the hot-row cache and the prefetch stream."""

    def __init__(self, table: HostTable):
        import cupy

        self.table = table
        layout = table._layout
        self.dtype_name = table.dtype.name
        self.w_ptr = device_pointer(table._weights.view(np.ndarray), "weights")
        self.s_ptr = device_pointer(table._state.view(np.ndarray), "state")
        self.w_stride = table._weights.strides[0] // table.dtype.itemsize
        self.s_stride = table._state.strides[0] // table.dtype.itemsize
        self.vec = self._vector_width(layout)
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        # Kernels that reach host RAM are latency-bound: a few blocks per SM keep enough
        # loads in flight for the link; prefetches take fewer, leaving SMs to the compute
        # they overlap.
        self.max_blocks, self.prefetch_blocks = 4 * sms, max(8, sms // 4)
        self.hyper = None
        self.stats = dict(lookups=0, hits=0, misses=0, admitted=0, evicted=0)
        self.pending = None  # (idx, plan, rows, event) of a prefetch
        self.side_stream = None
        self.last_event = None
        k = table.cache_rows
        self.cache_width = layout.row_width
        if k:
            self.cache = cupy.empty((k, layout.row_width), dtype=table.dtype)
            # One scratch entry past the end of each map takes writes that have no target.
            self.slot_of_row = cupy.full(table.num_rows + 1, -1, dtype=np.int32)
            self.row_of_slot = cupy.full(k, -1, dtype=np.int64)
            self.last_used = cupy.zeros(k + 1, dtype=np.int64)
            self.uses = cupy.zeros(k + 1, dtype=np.int64)
            self.seen = cupy.zeros(table.num_rows + 1, dtype=np.uint8)
            self.doorkeeper = table.cache_admission == "second-sight"
            self.tick = 0
            self.filled = 0
        else:
            self.cache = self.slot_of_row = None

    # -------------------------------------------------------------- helpers

    def _vector_width(self, layout) -> int:
        """16-byte words per lane where every row part and pointer allows it, else 1."""
        word = 16 // self.table.dtype.itemsize
        units = (layout.dim, layout.state_width, layout.state_offset, self.w_stride,
                 self.s_stride)
        aligned = all(u % word == 0 for u in units) and self.w_ptr % 16 == 0 \
            and self.s_ptr % 16 == 0
        return word if aligned else 1

    def _grid(self, n_warps: int, prefetch: bool = False):
        from xferlib._kernels import launch_config

        cap = self.prefetch_blocks if prefetch else self.max_blocks
        return launch_config(n_warps, max_blocks=cap)

    def _cache_args(self):
        layout = self.table._layout
        if self.cache is None:
            return (np.uint64(0), np.int64(0), np.int64(layout.state_offset), np.uint64(0))
        return (self.cache, np.int64(self.cache_width), np.int64(layout.state_offset),
                self.slot_of_row)

    def _host_args(self):
        return (np.uint64(self.w_ptr), np.int64(self.w_stride), np.uint64(self.s_ptr),
                np.int64(self.s_stride), np.int64(self.table.num_rows))

    def _hyper_array(self):
        import cupy

        if self.hyper is None:
            values = [float(v) for v in self.table._rule.kernel_hyper(self.table._hyper)]
            self.hyper = cupy.asarray(np.array(values + [0.0] * (16 - len(values))))
        return self.hyper

    def _plan(self, idx, stream) -> _Plan:
        import cupy

        from xferlib._kernels.table import TABLE_MODULE, run_starts_name

        idx = _to_gpu_indices(idx, self.table.num_rows)
        keys, perm, verdict = _sorted_positions(idx, self.table.num_rows, stream)
        n = keys.size
        flags = cupy.empty(n, dtype=np.int64)
        if n:
            blocks = max(1, min(4096, -(-n // 256)))
            TABLE_MODULE.get_function(run_starts_name(keys.dtype.itemsize))(
                (blocks,), (256,), (keys, np.int64(n), flags), stream=stream)
        run = cupy.cumsum(flags)
        run -= 1
        return _Plan(idx, keys, perm, run, verdict)

    def _record(self, stream) -> None:
        import cupy

        self.last_event = cupy.cuda.Event(disable_timing=True)
        self.last_event.record(stream)

    def _join_prefetch(self, stream) -> None:
        if self.pending is not None:
            stream.wait_event(self.pending[3])

    def _gather_unique(self, plan: _Plan, stream, full: bool = False, prefetch: bool = False):
        import cupy

        from xferlib._kernels.table import TABLE_MODULE, gather_unique_name

        layout = self.table._layout
        width = layout.dim + (layout.state_width if full else 0)
        out = cupy.empty((plan.n, width), dtype=self.table.dtype)
        if plan.n:
            grid, block = self._grid(plan.n, prefetch)
            name = gather_unique_name(self.vec, self.dtype_name, plan.keys.itemsize)
            TABLE_MODULE.get_function(name)(
                grid, block, (*self._host_args(), *self._cache_args(), plan.keys, plan.run,
                              np.int64(plan.n), np.int64(layout.dim),
                              np.int64(layout.state_width), np.int32(full), out, plan.verdict),
                stream=stream)
        return out

    def _expand(self, plan: _Plan, uniq, out, stream):
        import cupy

        from xferlib._kernels.table import TABLE_MODULE, expand_rows_name

        dim = self.table.dim
        if out is None:
            out = cupy.empty((plan.n, dim), dtype=self.table.dtype)
        total = plan.n * dim
        if total:
            blocks = max(1, min(65535, -(-total // 256)))
            TABLE_MODULE.get_function(expand_rows_name(self.dtype_name))(
                (blocks,), (256,), (uniq, plan.run, plan.perm, np.int64(plan.n), np.int64(dim),
                                    out, plan.verdict), stream=stream)
        return out

    def _check_out(self, out, n):
        if out is None:
            return
        if not is_cupy_array(out) or out.shape != (n, self.table.dim) \
                or out.dtype != self.table.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous CuPy array of shape "
                             f"{(n, self.table.dim)} and dtype {self.table.dtype}")

    # -------------------------------------------------------------- lookup

    def lookup(self, idx, out, stream):
        import cupy

        stream = as_cupy_stream(stream)
        self._check_out(out, idx.shape[0])
        if idx.shape[0] == 0:
            rows = out if out is not None else cupy.empty((0, self.table.dim), self.table.dtype)
            return rows, self._empty_plan(idx)
        with stream:
            pending, self.pending = self.pending, None
            if pending is not None and pending[0] is idx:
                _, plan, uniq, event = pending
                stream.wait_event(event)
            else:
                if pending is not None:
                    stream.wait_event(pending[3])
                plan, uniq = self._plan(idx, stream), None
            checked = self.cache is not None and plan.n > 0
            if checked:  # admission needs valid rows: read the verdict first (a sync)
                _raise_if_bad(plan.verdict, plan.idx, self.table.num_rows, stream)
                self._admit(plan, stream)
            if uniq is None:
                uniq = self._gather_unique(plan, stream)
            rows = self._expand(plan, uniq, out, stream)
            if not checked:
                _raise_if_bad(plan.verdict, plan.idx, self.table.num_rows, stream)
            self._record(stream)
        return rows, plan

    def _empty_plan(self, idx) -> _Plan:
        import cupy

        empty = cupy.empty(0, dtype=np.int64)
        return _Plan(idx, empty, empty, empty,
                     cupy.full(2, np.iinfo(np.uint64).max, dtype=np.uint64))

    # -------------------------------------------------------------- cache

    def _admit(self, plan: _Plan, stream) -> None:
        """Count hits, then admit missed rows into the least recently (or least often) used
        slots this batch does not use, writing the evicted rows back first. One host sync
        (the number of misses); victims are picked by one sort of the slots' scores."""
        import cupy

        from xferlib._kernels.table import TABLE_MODULE, swap_slots_name

        n, k = plan.n, self.cache.shape[0]
        uniq = cupy.empty(n, dtype=np.int64)
        uniq[plan.run] = plan.keys  # each run's row at the run's id (repeats write alike)
        valid = cupy.arange(n) <= plan.run[-1]
        slots = cupy.where(valid, self.slot_of_row[cupy.where(valid, uniq, 0)], -1)
        hit = slots >= 0
        self.tick += 1
        touched = cupy.where(hit, slots, k)  # slot k: a scratch entry for the non-hits
        self.last_used[touched] = self.tick
        self.uses[touched] += 1
        # A missed row is admitted only on its second sight (a doorkeeper, as TinyLFU's):
        # under a Zipf law most misses are tail rows seen once, and admitting each would
        # move its full row in and a victim's out for nothing.
        seen = self.seen[cupy.where(valid, uniq, self.table.num_rows)]
        self.seen[cupy.where(valid & ~hit, uniq, self.table.num_rows)] = 1
        eligible = valid & ~hit & (seen > 0) if self.doorkeeper else valid & ~hit
        missed = uniq[cupy.flatnonzero(eligible)]  # the one sync: how many to admit
        counts = cupy.stack([plan.run[-1] + 1, cupy.count_nonzero(valid & ~hit)]).get()
        n_unique, n_miss = int(counts[0]), int(counts[1])
        n_hit = n_unique - n_miss
        admit = min(int(missed.size), k - n_hit)
        self.stats["lookups"] += n_unique
        self.stats["hits"] += n_hit
        self.stats["misses"] += n_miss
        if admit <= 0:
            return
        score = self.last_used[:k] if self.table.cache_policy == "lru" else self.uses[:k]
        score = cupy.where(self.row_of_slot < 0, -1, score)
        score = cupy.where(self.last_used[:k] == self.tick, np.iinfo(np.int64).max, score)
        victims = cupy.argsort(score)[:admit].astype(np.int32)
        old_rows = self.row_of_slot[victims]
        new_rows = missed[:admit]
        grid, block = self._grid(admit)
        layout = self.table._layout
        TABLE_MODULE.get_function(swap_slots_name(self.vec, self.dtype_name))(
            grid, block, (*self._host_args(), self.cache, np.int64(self.cache_width),
                          np.int64(layout.dim), np.int64(layout.state_offset), victims,
                          old_rows, new_rows, np.int64(admit)), stream=stream)
        # Evicted rows (old_rows >= 0) leave the map; empty slots (-1) touch the scratch entry.
        self.slot_of_row[cupy.where(old_rows >= 0, old_rows, self.table.num_rows)] = -1
        self.slot_of_row[new_rows] = victims
        self.row_of_slot[victims] = new_rows
        self.last_used[victims] = self.tick
        self.uses[victims] = 1
        empty = min(admit, k - self.filled)  # empty slots score lowest, so they go first
        self.stats["admitted"] += admit
        self.stats["evicted"] += admit - empty
        self.filled += empty

    def flush(self, drop_cache: bool) -> None:
        import cupy

        from xferlib._kernels.table import TABLE_MODULE, swap_slots_name

        stream = cupy.cuda.get_current_stream()
        self._join_prefetch(stream)
        self.pending = None
        if self.last_event is not None:
            stream.wait_event(self.last_event)
        if self.cache is not None:
            k = self.cache.shape[0]
            slots = cupy.arange(k, dtype=np.int32)
            grid, block = self._grid(k)
            layout = self.table._layout
            TABLE_MODULE.get_function(swap_slots_name(self.vec, self.dtype_name))(
                grid, block, (*self._host_args(), self.cache, np.int64(self.cache_width),
                              np.int64(layout.dim), np.int64(layout.state_offset), slots,
                              self.row_of_slot, np.uint64(0), np.int64(k)), stream=stream)
            if drop_cache:
                cached = self.row_of_slot[self.row_of_slot >= 0]
                self.slot_of_row[cached] = -1
                self.row_of_slot[...] = -1
                self.filled = 0
        stream.synchronize()

    # -------------------------------------------------------------- update

    def apply(self, idx, grads, stream) -> None:
        import cupy

        from xferlib._kernels.table import TABLE_MODULE, refresh_rows_name, sparse_update_name

        table = self.table
        stream = as_cupy_stream(stream)
        if (idx.n if isinstance(idx, _Plan) else idx.shape[0]) == 0:
            return
        with stream:
            grads = cupy.ascontiguousarray(grads, dtype=table.dtype)
            plan = idx if isinstance(idx, _Plan) else self._plan(idx, stream)
            n, dim = plan.n, table.dim
            if n:
                summed = self._sum_gradients(plan, grads, stream)
                grid, block = self._grid(n)
                kernel = sparse_update_name(table._rule.kind, self.vec, self.dtype_name,
                                            plan.keys.itemsize)
                TABLE_MODULE.get_function(kernel)(
                    grid, block, (*self._host_args(), *self._cache_args(), plan.keys, plan.run,
                                  np.int64(n), summed, np.int64(dim),
                                  np.int64(len(table._layout.slots)),
                                  np.int64(table._layout.step_offset), self._hyper_array(),
                                  plan.verdict), stream=stream)
                if self.pending is not None:
                    # The prefetch ran beside this update and may hold rows from before it:
                    # once it is done, re-read the rows both touched (nothing else changed).
                    _, pplan, prows, done = self.pending
                    stream.wait_event(done)
                    if pplan.n:
                        grid, block = self._grid(pplan.n)
                        TABLE_MODULE.get_function(
                            refresh_rows_name(self.dtype_name, pplan.keys.itemsize))(
                            grid, block, (*self._host_args(), *self._cache_args(), pplan.keys,
                                          pplan.run, np.int64(pplan.n), plan.keys, np.int64(n),
                                          np.int64(dim), prows), stream=stream)
            if not isinstance(idx, _Plan):
                _raise_if_bad(plan.verdict, plan.idx, table.num_rows, stream)
            self._record(stream)

    def _sum_gradients(self, plan: _Plan, grads, stream):
        """Each run's gradient sum, in sorted-position order: deterministic."""
        import cupy

        from xferlib._kernels.table import (SUM_CHUNK, TABLE_MODULE, sum_chunks_name,
                                            sum_spans_name)

        n, dim = plan.n, self.table.dim
        chunks = -(-n // SUM_CHUNK)
        summed = cupy.empty((n, dim), dtype=self.table.dtype)  # rows past the last run unused
        head = cupy.empty((chunks, dim), dtype=self.table.dtype)
        tail = cupy.empty((chunks, dim), dtype=self.table.dtype)
        blocks = max(1, min(65535, -(-chunks * dim // 256)))
        key_bytes = plan.keys.itemsize
        TABLE_MODULE.get_function(sum_chunks_name(self.dtype_name, key_bytes))(
            (blocks,), (256,), (grads, plan.keys, plan.run, plan.perm, np.int64(n),
                                np.int64(dim), summed, head, tail), stream=stream)
        TABLE_MODULE.get_function(sum_spans_name(self.dtype_name, key_bytes))(
            (blocks,), (256,), (plan.keys, plan.run, np.int64(n), np.int64(dim), summed, head,
                                tail), stream=stream)
        return summed

    # -------------------------------------------------------------- prefetch

    def prefetch(self, idx, stream) -> None:
        import cupy

        main = as_cupy_stream(stream)
        if self.side_stream is None:
            self.side_stream = _high_priority_stream()
        self._join_prefetch(main)  # one prefetch in flight at a time
        side = self.side_stream
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(main)
        side.wait_event(ready)  # after every update queued so far
        with side:
            plan = self._plan(idx, side)
            rows = self._gather_unique(plan, side, prefetch=True)
            done = cupy.cuda.Event(disable_timing=True)
            done.record(side)
        self.pending = (idx, plan, rows, done)
