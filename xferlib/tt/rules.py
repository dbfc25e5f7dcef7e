"""The sparse optimizer rules of TT cores and cached rows on the array path (FBGEMM's rules of
these names), their state per parameter row, and :func:`tt_sparse_update`."""

from __future__ import annotations

import numpy as np

from xferlib._backend import array_module
from xferlib.optim.rules import TT, optimizers_for
from xferlib.tt.plan import TTBagPlan
from xferlib.tt.shape import TTShape

__all__ = ["SPARSE_OPTIMIZERS", "tt_sparse_state", "tt_sparse_update"]


# The rules TT runs (xferlib.optim.rules: one vocabulary for every family), with the
# hyperparameters FBGEMM gives them (no momentum, weight decay or maximize where FBGEMM has
# none); the kernels dispatch on their xferlib.optim.rules.OptId ids.
SPARSE_OPTIMIZERS = optimizers_for(TT)
# Optimizers that update only the rows a batch touched (a zero gradient still moves their
# state or weights): the others update whole cores at once.
LAZY_OPTIMIZERS = ("rowwise_adam", "lamb", "lars_sgd", "partial_rowwise_adam",
                   "partial_rowwise_lamb")


def tt_sparse_state(shape: TTShape, optimizer: str, xp=np) -> list[dict]:
    """Zeroed optimizer state per core for :func:`tt_sparse_update` (``xp``: numpy or cupy,
    where the cores live)."""
    return [row_state(*shape.core_shape(k), optimizer, xp) for k in range(shape.d)]


# Each optimizer's state per parameter row, primary entry first (FBTT's ``optimizer_state``):
# "elem" a float32 value per element, "row" one float32 per row, "step" an int64 count per row.
# The kernels' update_row takes them as [elem, second elem, row, step] pointers.
STATE_SLOTS = {
    "sgd": (),
    "adagrad": (("sum", "elem"),),
    "rowwise_adagrad": (("sum", "row"),),
    "rowwise_adam": (("exp_avg", "elem"), ("exp_avg_sq", "row"), ("step", "step")),
    "lamb": (("exp_avg", "elem"), ("exp_avg_sq", "elem")),
    "lars_sgd": (("momentum", "elem"),),
    "partial_rowwise_adam": (("exp_avg", "elem"), ("exp_avg_sq", "row")),
    "partial_rowwise_lamb": (("exp_avg", "elem"), ("exp_avg_sq", "row")),
}


def state_layout(rows: int, width: int, optimizer: str, dtype=np.float32) -> dict:
    """``{name: (shape, dtype)}`` of the optimizer state :func:`row_state` makes for ``rows``
    parameter rows of ``width`` (nothing allocated); float state in the cores' ``dtype``."""
    where = {"elem": ((rows, width), dtype), "row": ((rows,), dtype),
             "step": ((rows,), np.int64)}
    return {name: where[kind] for name, kind in STATE_SLOTS[optimizer]}


def row_state(rows: int, width: int, optimizer: str, xp=np) -> dict:
    """Zeroed state of ``optimizer`` for ``rows`` parameter rows of ``width``; the first entry
    is the primary one (FBTT's ``optimizer_state``)."""
    if optimizer not in SPARSE_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {SPARSE_OPTIMIZERS}, got {optimizer!r}")
    return {name: xp.zeros(shape, dtype)
            for name, (shape, dtype) in state_layout(rows, width, optimizer).items()}


def state_pointers(state: dict, optimizer: str) -> list:
    """``[elementwise, second elementwise, per row, per-row steps]`` state of one parameter
    (NULL where the optimizer has none), as the kernels' ``update_row`` takes them."""
    pointers = [np.uint64(0)] * 4  # NULL
    elem = 0
    for name, where in STATE_SLOTS[optimizer]:
        if where == "elem":
            position, elem = elem, elem + 1
        else:
            position = 2 if where == "row" else 3
        # a step count may be absent (the kernel then reads none); other state may not
        pointers[position] = state.get(name, pointers[position]) if where == "step" else \
            state[name]
    return pointers


def tt_sparse_update(cores, shape: TTShape, residuals, grads, states, optimizer: str, *,
                     lr: float, eps: float = 1e-10, betas=(0.9, 0.999), **hyper) -> None:
    """Apply ``optimizer`` in place to every core row the batch touched (all of them: no row
    of any core is skipped), from the core gradients of :func:`tt_embedding_bag_bwd`.

    ``sgd``: ``G -= lr g``. ``adagrad``: elementwise ``s += g^2; G -= lr g / (sqrt(s) + eps)``.
    ``rowwise_adagrad``: one accumulator per core row, ``s += mean(g^2)``. ``rowwise_adam``:
    elementwise first moment, one second moment and step count per row, bias-corrected.
    ``lamb``, ``lars_sgd``, ``partial_rowwise_adam``, ``partial_rowwise_lamb``: FBGEMM's rules
    of these names, per row (see :func:`update_rows`), with ``hyper``: ``weight_decay``
    (0), ``eta`` (0.001, LARS), ``momentum`` (0.9, LARS) and ``step`` (the global iteration,
    from 1, for the bias corrections).
    Rows the batch did not touch keep their values and state (lazy semantics).
    """
    check_sparse_args(optimizer, lr)
    digits = shape.digits(residuals.indices if isinstance(residuals, TTBagPlan) else
                          residuals[0])
    xp = array_module(digits)
    # A core row the batch did not touch has a zero gradient, which leaves it and its sgd /
    # adagrad / row-wise adagrad state exactly as they are (eps > 0 keeps 0 / sqrt(0) away):
    # those update the whole (small) core at once, with no sort and no host sync.
    whole = optimizer == "sgd" or (optimizer in ("adagrad", "rowwise_adagrad") and eps > 0)
    for k, (core, grad, state) in enumerate(zip(cores, grads, states)):
        rows = slice(None) if whole else xp.unique(digits[:, k])
        update_rows(core, grad, state, rows, optimizer, lr, eps, betas, **hyper)


def check_sparse_args(optimizer: str, lr: float) -> None:
    if optimizer not in SPARSE_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {SPARSE_OPTIMIZERS}, got {optimizer!r}")
    if lr < 0:
        raise ValueError(f"Invalid learning rate: {lr}")


def update_rows(param, grad, state, rows, optimizer: str, lr: float, eps: float, betas, *,
                weight_decay: float = 0.0, eta: float = 0.001, momentum: float = 0.9,
                step: int = 1) -> None:
    """``optimizer`` on rows ``rows`` of a 2-D ``param`` (a core, or a cache of dense rows) from
    their gradient rows, in place, with ``state`` shaped as :func:`tt_sparse_state` makes it.

    FBGEMM's rules, per row ``w`` with gradient ``g`` (``t = step``, the global iteration):
    ``lamb``: ``m, v`` elementwise Adam moments, ``r = m / (1 - b1^t) / (sqrt(v / (1 - b2^t))
    + eps) + weight_decay w``, ``w -= lr |w| / |r| r``. ``partial_rowwise_lamb``: the same with
    one ``v`` per row from ``mean(g^2)``. ``partial_rowwise_adam``: ``w -= lr (m / (1 - b1^t) /
    (sqrt(v / (1 - b2^t)) + eps) + weight_decay w)``, ``v`` per row. ``lars_sgd``: ``lr' = lr eta
    |w| / (|g| + weight_decay |w|)``, ``m = momentum m + lr' (g + weight_decay w)``, ``w -= m``.
    Where FBGEMM would divide 0 by 0 (a zero update or zero norms) the row is left unchanged.
    """
    xp = array_module(param)
    b1, b2 = betas
    f32 = np.float32
    g = grad[rows]
    if optimizer == "sgd":
        param[rows] -= f32(lr) * g
    elif optimizer == "adagrad":
        s = state["sum"]
        s[rows] += g * g
        param[rows] -= f32(lr) * g / (xp.sqrt(s[rows]) + f32(eps))
    elif optimizer == "rowwise_adagrad":
        s = state["sum"]
        s[rows] += (g * g).mean(axis=1)
        param[rows] -= f32(lr) * g / (xp.sqrt(s[rows])[:, None] + f32(eps))
    elif optimizer == "rowwise_adam":
        m, v, steps = state["exp_avg"], state["exp_avg_sq"], state["step"]
        steps[rows] += 1
        m[rows] = f32(b1) * m[rows] + f32(1 - b1) * g
        v[rows] = f32(b2) * v[rows] + f32(1 - b2) * (g * g).mean(axis=1)
        t = steps[rows].astype(np.float64)
        m_hat = m[rows] / (1 - b1 ** t)[:, None].astype(f32)
        v_hat = (v[rows] / (1 - b2 ** t)).astype(f32)
        param[rows] -= f32(lr) * m_hat / (xp.sqrt(v_hat)[:, None] + f32(eps))
    elif optimizer == "lars_sgd":
        w = param[rows]
        w_norm = xp.sqrt((w * w).sum(axis=1))
        denom = xp.sqrt((g * g).sum(axis=1)) + f32(weight_decay) * w_norm
        scale = xp.where(denom > 0, f32(lr * eta) * w_norm / xp.where(denom > 0, denom, 1), 0)
        mom = state["momentum"]
        mom[rows] = f32(momentum) * mom[rows] + scale[:, None].astype(f32) * (
            g + f32(weight_decay) * w)
        param[rows] = w - mom[rows]
    else:  # the Adam family with a global step
        w = param[rows]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        c1, c2 = f32(1 - b1 ** step), f32(1 - b2 ** step)
        m[rows] = f32(b1) * m[rows] + f32(1 - b1) * g
        if optimizer == "lamb":
            v[rows] = f32(b2) * v[rows] + f32(1 - b2) * g * g
            denom = xp.sqrt(v[rows] / c2) + f32(eps)
        else:
            v[rows] = f32(b2) * v[rows] + f32(1 - b2) * (g * g).mean(axis=1)
            denom = (xp.sqrt(v[rows] / c2) + f32(eps))[:, None]
        update = m[rows] / c1 / denom + f32(weight_decay) * w
        if optimizer == "partial_rowwise_adam":
            param[rows] = w - f32(lr) * update
            return
        w_norm = xp.sqrt((w * w).sum(axis=1))
        u_norm = xp.sqrt((update * update).sum(axis=1))
        ratio = xp.where(u_norm > 0, w_norm / xp.where(u_norm > 0, u_norm, 1), 0).astype(f32)
        param[rows] = w - f32(lr) * ratio[:, None] * update
