"""Sparse optimizer rules of host tables, and the float64 reference they are tested against.

Each rule updates the rows of a batch in place: ``w`` (rows x dim), the state slots (same
shape), row scalars (rows,), ``g`` the summed gradients and ``t`` the rows' step counts after
this step (rows x 1), all in the table's dtype. These NumPy functions are the NumPy path, and
run in float64 they are the reference (:func:`sparse_update_reference`). The CUDA versions
are in ``xferlib/_kernels/table.py``. Each rule's id, defaults, argument check and state slots
are the shared ones of ``xferlib.optim.rules``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from xferlib.optim.rule_rows import device_hyper
from xferlib.optim.rules import RULES, first_moment, second_moment
from xferlib.table.layout import split_state

__all__ = ["SPARSE_OPTIMIZERS", "HYPER_ROW", "optimizer_defaults", "sparse_update_reference"]

HYPER_ROW = 16  # doubles of one table's hyperparameter row on the device
# Public for the rest of the table package, outside __all__: sparse_rule, resolve_hyper,
# sum_duplicates.


def _row_scalars(name, h, t):
    """The shared rule's per-step scalars (its named record) with each row's step count
    (float64 arrays)."""
    return RULES[name].scalars(h, t.astype(np.float64), {}, np)


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
    first_moment(m, g, b1)
    second_moment(v, g, b2)
    if h["amsgrad"]:
        np.maximum(s["max_exp_avg_sq"], v, out=s["max_exp_avg_sq"])
        v = s["max_exp_avg_sq"]
    c = _row_scalars("adam", h, t)  # the flat rule's scalars, one per row
    step_size, bc2_sqrt = c.step_size.astype(w.dtype), c.bc2_sqrt.astype(w.dtype)
    w -= step_size * (m / (np.sqrt(v) / bc2_sqrt + f(h["eps"])))


def _adamw(h, w, s, r, g, t):
    _adam(h, w, s, r, g, t, decoupled=True)


def _adagrad(h, w, s, r, g, t):
    f = w.dtype.type
    g = _l2(h, w, _signed(h, g))
    clr = _row_scalars("adagrad", h, t).clr.astype(w.dtype)
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
    first_moment(m, g, b1)
    np.maximum(u * f(b2), np.abs(g) + f(h["eps"]), out=u)
    w -= _row_scalars("adamax", h, t).clr.astype(w.dtype) * (m / u)


def _rmsprop(h, w, s, r, g, t):
    f = w.dtype.type
    alpha = h["alpha"]
    g = _l2(h, w, _signed(h, g))
    sq = s["square_avg"]
    second_moment(sq, g, alpha)
    if h["centered"]:
        ga = s["grad_avg"]
        first_moment(ga, g, alpha)
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
    eps = f(h["eps"])
    g = _l2(h, w, _signed(h, g))
    sq, acc = s["square_avg"], s["acc_delta"]
    second_moment(sq, g, h["rho"])
    delta = np.sqrt(acc + eps) / np.sqrt(sq + eps) * g
    second_moment(acc, delta, h["rho"])
    w -= f(h["lr"]) * delta


@dataclasses.dataclass(frozen=True)
class _SparseRule:
    kind: int  # the kernel's RULE: the shared rule's id (xferlib.optim.rules.OptId)
    defaults: dict
    slots: Callable  # hyper -> names of full-width state slots, in storage order
    row_scalars: tuple  # names of per-row scalar state
    initial: Callable  # hyper -> initial value of the state
    kernel_hyper: Callable  # hyper -> the doubles the kernel reads
    update: Callable
    check: Callable

    def kernel_row(self, hyper) -> np.ndarray:
        """``kernel_hyper(hyper)`` as the update kernels read it: ``HYPER_ROW`` float64
        values, zeros after the rule's own."""
        values = [float(v) for v in self.kernel_hyper(hyper)]
        return np.array(values + [0.0] * (HYPER_ROW - len(values)), dtype=np.float64)


def _zero(h):
    return 0.0


def _sparse(name: str, update, row_scalars=(), initial=_zero) -> _SparseRule:
    """The host-table form of the shared rule ``name``: its id, defaults, argument check,
    state slots and device row of hyperparameters (``device_hyper``: Adam and AdamW share
    the kernel rule, AdamW's row flags its decoupled decay) come from
    ``xferlib.optim.rules``; the row math is this family's."""
    shared = RULES[name]
    return _SparseRule(shared.kind, shared.defaults, shared.buffers, row_scalars, initial,
                       lambda h: device_hyper(name, h), update, shared.check)


_RULES = {
    "sgd": _sparse("sgd", _sgd),
    "adam": _sparse("adam", _adam),
    "adamw": _sparse("adamw", _adamw),
    "adagrad": _sparse("adagrad", _adagrad, initial=lambda h: h["initial_accumulator_value"]),
    # FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row, fed the mean squared gradient.
    "rowwise_adagrad": _sparse("rowwise_adagrad", _rowwise_adagrad, row_scalars=("sum",),
                               initial=lambda h: h["initial_accumulator_value"]),
    "adamax": _sparse("adamax", _adamax),
    "rmsprop": _sparse("rmsprop", _rmsprop),
    "adadelta": _sparse("adadelta", _adadelta),
}

SPARSE_OPTIMIZERS = tuple(_RULES)


def optimizer_defaults(name: str) -> dict:
    """The hyperparameters and defaults of sparse optimizer ``name`` (torch.optim's)."""
    return dict(sparse_rule(name).defaults)


def sparse_rule(name: str) -> _SparseRule:
    try:
        return _RULES[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; one of {SPARSE_OPTIMIZERS} "
                         f"(or None for lookups only)") from None


def resolve_hyper(name: str, overrides) -> dict:
    rule = sparse_rule(name)
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(rule.defaults))
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {unknown} for {name!r}; "
                         f"known: {sorted(rule.defaults)}")
    # NumPy scalars and 0-d arrays as Python numbers: a shared table's JSON header takes
    # neither, a saved file's configuration no 0-d array.
    h = {k: v.item() if isinstance(v, (np.generic, np.ndarray)) and np.ndim(v) == 0 else v
         for k, v in {**rule.defaults, **overrides}.items()}
    if "betas" in h:
        h["betas"] = tuple(float(b) for b in h["betas"])
        if len(h["betas"]) != 2:
            raise ValueError(f"betas must be a pair, got {h['betas']}")
    rule.check(h)
    return h


def sum_duplicates(idx: np.ndarray, grads: np.ndarray):
    """Sorted unique rows and their summed gradients, accumulated in float64 in batch order
    (one ``bincount`` over (row, column) pairs: deterministic, and faster than a reduceat)."""
    rows, inverse = np.unique(idx, return_inverse=True)
    dim = grads.shape[1]
    cells = (inverse.reshape(-1, 1) * dim + np.arange(dim)).ravel()
    summed = np.bincount(cells, weights=np.asarray(grads, dtype=np.float64).ravel(),
                         minlength=rows.size * dim)
    return rows, summed.reshape(rows.size, dim).astype(grads.dtype, copy=False)


def update_rows(rule, hyper: dict, layout, weights, state, idx, grads) -> None:
    """The NumPy path of one sparse step, in place: ``weights`` (rows x dim) and ``state``
    (rows x the layout's state width) of a table in ``layout``; the gradients of repeated
    ``idx`` are summed, then ``rule`` runs once on each touched row with its own step."""
    rows, g = sum_duplicates(np.asarray(idx), np.asarray(grads, dtype=weights.dtype))
    w, s = weights[rows], state[rows]
    slots, scalars, steps = split_state(layout, s)
    t = steps + 1
    rule.update(hyper, w, slots, scalars, g, t[:, None])
    steps[...] = t
    weights[rows] = w
    state[rows] = s


def sparse_update_reference(name: str, weights, state: dict, steps, idx, grads,
                            hyper: dict | None = None):
    """The sparse optimizer ``name`` in float64 on copies: the oracle for HostTable.

    ``weights`` (num_rows x dim), ``state`` (slot name -> num_rows x dim, row-scalar name ->
    num_rows), ``steps`` (num_rows,) ints; ``idx`` (n,) and ``grads`` (n x dim). Duplicate
    indices' gradients are summed; only the rows present are updated (lazy semantics).
    Returns ``(weights, state, steps)``.
    """
    rule = sparse_rule(name)
    h = resolve_hyper(name, hyper)
    weights = np.array(weights, dtype=np.float64)
    state = {k: np.array(v, dtype=np.float64) for k, v in state.items()}
    steps = np.array(steps, dtype=np.int64)
    idx = np.asarray(idx).astype(np.int64)
    if idx.size == 0:
        return weights, state, steps
    rows, g = sum_duplicates(idx, np.asarray(grads, dtype=np.float64))
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


