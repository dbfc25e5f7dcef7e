"""Optimizer rules: each optimizer's concept written once, for every kernel family.

A :class:`Rule` holds what an optimizer is, apart from where its arrays live: its name and
enum id (:class:`OptId`, the integer every CUDA family dispatches on), torch.optim's
hyperparameter names and defaults (optax's for lion), the argument check (ValueError as torch
raises), its state slots in the kernels' order, the per-step scalars (bias corrections, step
sizes) and the NumPy elementwise update, the reference the flat kernel follows.

The per-step scalars take the array namespace ``xp`` (``math``-like calls on Python floats go
through it), so NumPy, CuPy and ``jax.numpy`` compute them from one definition; with
``xp=numpy`` and a Python int step they are float64 host values.

Kernels never copy an id or a constant by hand: :func:`cuda_defines` writes ``#define
XF_OPT_<NAME> <id>`` lines and :func:`cuda_constants` the numbers they take from the rules
(``XF_MAX_SLOTS``); ``xferlib/optim/rule_rows.py`` lays out the rows of hyperparameters and
scalars the kernels read, and writes their columns' ``#define`` lines.

The elementwise CUDA math is shared too: ``xferlib/_kernels/rules.py`` holds one
``__device__`` function per rule (SGD with momentum/nesterov, Adam/AdamW, Adagrad, RMSprop,
Adamax, NAdam, RAdam, Lion, Adadelta, and the per-element parts of FBGEMM's row-wise rules),
templated on the compute type and taking an ``XfScalars`` struct; the flat, host-table and
TT sources start with that snippet (and the ``#define`` blocks) and call it. Each family still
computes the scalars where it did, because that is what its reference rounds like: the flat
kernel reads float32 values this module computes on the host per segment, the host-table
kernel derives them in double on the device from each row's own step (float or double
tables), TT from its hyperparameters and the global or per-row step. Not shared: FBGEMM's
row-wise rules (row-wise Adagrad and Adam, LAMB, LARS, host tables and TT) need a reduction
over the row first; each family keeps that reduction and the row scalar it gives and calls
the shared per-element step.

>>> from xferlib.optim.rules import RULES, OptId, resolve_hyper
>>> RULES["adamw"].kind == OptId.ADAM  # AdamW runs Adam's kernel rule, decay decoupled
True
>>> resolve_hyper("adam", {"lr": 0.1})["betas"]
(0.9, 0.999)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import Callable

import numpy as np

from xferlib.optim.scalar_records import (AdagradScalars, AdamaxScalars, AdamScalars,
                                          LionScalars, NadamScalars, RadamScalars,
                                          RmspropScalars, SgdScalars)

__all__ = ["OptId", "Rule", "known_scalar", "RULES", "FLAT_RULES", "OPTIMIZERS", "COMMON",
           "SCALARS", "get_rule", "resolve_hyper", "common_scalars", "preamble_numpy",
           "check_common", "cuda_defines", "cuda_constants", "FLAT", "TABLE", "TT",
           "optimizers_for", "SgdScalars", "AdamScalars", "AdagradScalars", "RmspropScalars",
           "AdamaxScalars", "NadamScalars", "RadamScalars", "LionScalars", "first_moment",
           "second_moment"]

# The kernel families a rule runs in: the flat step (xferlib.optim), host tables
# (xferlib.table), TT tables (xferlib.tt). One vocabulary: a name means one rule in every
# family that runs it (each family takes the hyperparameters it has; see Rule.families).
FLAT, TABLE, TT = "flat", "table", "tt"


class OptId(enum.IntEnum):
    """One id per optimizer rule, shared by every kernel family (flat, host-table rows, TT).

    A family compiles only the rules it has; ids never change meaning between families."""

    SGD = 0
    ADAM = 1  # adam and adamw (decoupled decay is a scalar of the rule, not a rule)
    ADAGRAD = 2
    RMSPROP = 3
    ADAMAX = 4
    NADAM = 5
    RADAM = 6
    LION = 7
    ROWWISE_ADAGRAD = 8  # FBGEMM's EXACT_ROWWISE_ADAGRAD (host tables, TT)
    ADADELTA = 9  # host tables
    ROWWISE_ADAM = 10  # TT (FBGEMM's rules from here on)
    LAMB = 11
    LARS_SGD = 12
    PARTIAL_ROWWISE_ADAM = 13
    PARTIAL_ROWWISE_LAMB = 14


def cuda_defines() -> str:
    """``#define XF_OPT_<NAME> <id>`` for every :class:`OptId`: the only place kernel sources
    get optimizer ids from (generated text, never copied by hand)."""
    lines = ["// Optimizer ids, generated from xferlib.optim.rules.OptId (do not edit)."]
    lines += [f"#define XF_OPT_{o.name} {int(o)}" for o in OptId]
    return "\n".join(lines) + "\n"


def cuda_constants() -> str:
    """``#define`` lines for the numbers kernels take from the rules (generated, never
    copied): ``XF_MAX_SLOTS``, the most elementwise state slots any rule has (the host-table
    kernel stages that many per element).

    >>> cuda_constants()
    '#define XF_MAX_SLOTS 3\\n'
    """
    return f"#define XF_MAX_SLOTS {max(len(r.slots) for r in RULES.values())}\n"


# ----------------------------------------------------------------------------- the rules
#
# Each rule has three parts: a hyperparameter check, per-segment scalars (float64 on the host
# with xp=numpy, from the segment's step count) and the elementwise update (NumPy here; CUDA in
# xferlib/_kernels/rules.py, shared by every kernel family). Before the rule runs, the
# gradient is negated for ``maximize`` and weight decay is applied the way torch applies it for
# that optimizer: added to the gradient (L2) or multiplied into the parameter (decoupled,
# AdamW-style). Elementwise code follows torch's op order so the float32 results track torch's.

SCALARS = 8  # rule-specific scalars per segment
COMMON = 3  # sign, L2 coefficient, decoupled decay factor


def known_scalar(value):
    """A scalar hyperparameter as a float; None while its value is traced (``jax.jit``,
    optax's ``inject_hyperparams``), whose check waits; NaN for what is no number."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if getattr(value, "shape", None) in ((), (1,)):  # a 0-d array: NumPy, JAX, torch
        try:
            return float(value)
        except TypeError:  # a tracer has no value yet (JAX raises a TypeError subclass)
            return None
    return float("nan")


def check_common(h: dict) -> None:
    """The checks every torch.optim rule makes: lr, weight_decay, eps, betas. Scalars may be
    Python or NumPy numbers or 0-d arrays (optax's schedules hand JAX arrays); traced ones
    are checked when they have values."""
    lr = known_scalar(h.get("lr", h.get("learning_rate")))
    if lr is not None and not lr >= 0:
        raise ValueError(f"Invalid learning rate: {h.get('lr', h.get('learning_rate'))}")
    for key, what in (("weight_decay", "weight_decay value"), ("eps", "epsilon value")):
        value = known_scalar(h.get(key, 0.0))
        if value is not None and not value >= 0:  # NaN too, as torch refuses it
            raise ValueError(f"Invalid {what}: {h[key]}")
    if "betas" in h:
        for k, beta in enumerate(h["betas"]):
            value = known_scalar(beta)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"Invalid beta parameter at index {k}: {beta}")


def _check_nonnegative(h: dict, *keys) -> None:
    check_common(h)
    for key in keys:
        value = known_scalar(h[key])
        if value is not None and not value >= 0:
            raise ValueError(f"Invalid {key} value: {h[key]}")


def _f32(x) -> np.float32:
    return np.float32(x)


def _sgd_check(h):
    _check_nonnegative(h, "momentum", "dampening")
    momentum, dampening = known_scalar(h["momentum"]), known_scalar(h["dampening"])
    if h["nesterov"] and momentum is not None and dampening is not None \
            and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def _select(xp, cond, a, b):
    """``a if cond else b``: a Python branch on host values, ``xp.where`` on traced arrays."""
    if isinstance(cond, (bool, np.bool_)):
        return a if cond else b
    return xp.where(cond, a, b)


def _sqrt(xp, x):
    # math.sqrt on host floats: the same correctly rounded value as xp.sqrt, without the
    # ufunc call (the eager GPU step computes these every step).
    return math.sqrt(x) if isinstance(x, float) else xp.sqrt(x)


# Each flat rule's per-step scalars are a named record (SgdScalars, ...):
# xferlib/optim/scalar_records.py.

# The moment updates, written once for NumPy (in place, in the arrays' dtype, 1 - beta
# rounded from float64; torch's op order): the flat rules and the host tables' rows use them.

def first_moment(m, g, b1) -> None:
    """``m <- m + (g - m)(1 - b1)``: torch's ``exp_avg.lerp_(grad, 1 - beta1)``."""
    m += (g - m) * m.dtype.type(1.0 - b1)


def second_moment(v, g, b2) -> None:
    """``v <- b2 v + (1 - b2) g^2``: torch's ``exp_avg_sq.mul_(beta2).addcmul_(grad, grad,
    value=1 - beta2)``."""
    f = v.dtype.type
    v *= f(b2)
    v += f(1.0 - b2) * g * g


def _sgd_scalars(h, step, extra, xp=np):
    first = step == 1  # torch's first step copies the gradient into the momentum buffer
    keep = _select(xp, first, 0.0, h["momentum"])
    take = _select(xp, first, 1.0, 1.0 - h["dampening"])
    return SgdScalars(h["lr"], h["momentum"], keep, take, float(h["momentum"] != 0),
                      float(h["nesterov"]))


def _sgd_numpy(c, p, g, b):
    if c.use_momentum:
        buf = b["momentum_buffer"]
        buf *= _f32(c.keep)
        buf += _f32(c.take) * g
        g = g + _f32(c.momentum) * buf if c.nesterov else buf
    p -= _f32(c.lr) * g


def _adam_scalars(h, step, extra, xp=np):
    b1, b2 = h["betas"]
    bc1 = 1.0 - b1 ** step
    return AdamScalars(h["lr"] / bc1, b1, b2, h["eps"], _sqrt(xp, 1.0 - b2 ** step),
                       float(h["amsgrad"]))


def _adam_numpy(c, p, g, b):
    m, v = b["exp_avg"], b["exp_avg_sq"]
    first_moment(m, g, c.b1)
    second_moment(v, g, c.b2)
    if c.amsgrad:
        np.maximum(b["max_exp_avg_sq"], v, out=b["max_exp_avg_sq"])
        v = b["max_exp_avg_sq"]
    denom = np.sqrt(v) / _f32(c.bc2_sqrt) + _f32(c.eps)
    p -= _f32(c.step_size) * (m / denom)


def _adagrad_check(h):
    _check_nonnegative(h, "lr_decay", "initial_accumulator_value")


def _adagrad_scalars(h, step, extra, xp=np):
    return AdagradScalars(h["lr"] / (1.0 + (step - 1) * h["lr_decay"]), h["eps"])


def _adagrad_numpy(c, p, g, b):
    s = b["sum"]
    s += g * g
    p -= _f32(c.clr) * (g / (np.sqrt(s) + _f32(c.eps)))


def _rmsprop_check(h):
    _check_nonnegative(h, "momentum", "alpha")


def _rmsprop_scalars(h, step, extra, xp=np):
    return RmspropScalars(h["lr"], h["alpha"], h["eps"], h["momentum"], float(h["centered"]))


def _rmsprop_numpy(c, p, g, b):
    sq = b["square_avg"]
    second_moment(sq, g, c.alpha)
    if c.centered:
        ga = b["grad_avg"]
        first_moment(ga, g, c.alpha)
        avg = np.sqrt(sq - ga * ga) + _f32(c.eps)
    else:
        avg = np.sqrt(sq) + _f32(c.eps)
    if c.momentum > 0:
        buf = b["momentum_buffer"]
        buf *= _f32(c.momentum)
        buf += g / avg
        p -= _f32(c.lr) * buf
    else:
        p -= _f32(c.lr) * (g / avg)


def _adamax_scalars(h, step, extra, xp=np):
    b1, b2 = h["betas"]
    return AdamaxScalars(h["lr"] / (1.0 - b1 ** step), b1, b2, h["eps"])


def _adamax_numpy(c, p, g, b):
    m, u = b["exp_avg"], b["exp_inf"]
    first_moment(m, g, c.b1)
    np.maximum(u * _f32(c.b2), np.abs(g) + _f32(c.eps), out=u)
    p -= _f32(c.clr) * (m / u)


def _nadam_check(h):
    _check_nonnegative(h, "momentum_decay")


def _nadam_scalars(h, step, extra, xp=np):
    # Host only: the momentum product is carried per segment in ``extra``.
    b1, b2 = h["betas"]
    mu = b1 * (1.0 - 0.5 * 0.96 ** (step * h["momentum_decay"]))
    mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * h["momentum_decay"]))
    mu_product = extra["mu_product"] * mu
    extra["mu_product"] = mu_product  # stored back per segment by the caller
    return NadamScalars(-h["lr"] * (1.0 - mu) / (1.0 - mu_product),
                        -h["lr"] * mu_next / (1.0 - mu_product * mu_next),
                        b1, b2, 1.0 - b2 ** step, h["eps"])


def _nadam_numpy(c, p, g, b):
    m, v = b["exp_avg"], b["exp_avg_sq"]
    first_moment(m, g, c.b1)
    second_moment(v, g, c.b2)
    denom = np.sqrt(v / _f32(c.bc2)) + _f32(c.eps)
    p += _f32(c.coef_grad) * (g / denom)
    p += _f32(c.coef_avg) * (m / denom)


def _radam_scalars(h, step, extra, xp=np):
    # Host only: the rectification branch is a Python branch on the step.
    b1, b2 = h["betas"]
    bc1 = 1.0 - b1 ** step
    bc2 = 1.0 - b2 ** step
    rho_inf = 2.0 / (1.0 - b2) - 1.0
    rho_t = rho_inf - 2.0 * step * (b2 ** step) / bc2
    if rho_t > 5.0:  # variance is tractable: rectified adaptive step
        rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf
                         / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        return RadamScalars(h["lr"] / bc1, b1, b2, h["eps"], math.sqrt(bc2), rect, 1.0)
    return RadamScalars(h["lr"] / bc1, b1, b2, h["eps"], math.sqrt(bc2), 0.0, 0.0)


def _radam_numpy(c, p, g, b):
    m, v = b["exp_avg"], b["exp_avg_sq"]
    first_moment(m, g, c.b1)
    second_moment(v, g, c.b2)
    if c.rectified:
        adaptive = _f32(c.bc2_sqrt) / (np.sqrt(v) + _f32(c.eps))
        p -= _f32(c.lr_bc1) * m * adaptive * _f32(c.rect)
    else:
        p -= _f32(c.lr_bc1) * m


def _lion_scalars(h, step, extra, xp=np):
    return LionScalars(h["learning_rate"], h["b1"], h["b2"], h["weight_decay"])


def _lion_numpy(c, p, g, b):
    # optax.lion: update = sign(b1 m + (1 - b1) g) + wd p;  m <- b2 m + (1 - b2) g
    m = b["exp_avg"]
    update = np.sign(_f32(c.b1) * m + _f32(1.0 - c.b1) * g)
    m *= _f32(c.b2)
    m += _f32(1.0 - c.b2) * g
    if c.weight_decay:
        update += _f32(c.weight_decay) * p
    p -= _f32(c.lr) * update


def _range_check(*keys, upper=None):
    """check_common plus ``0 <= h[key]`` (``<= upper``) for each key, torch's messages."""
    def check(h):
        check_common(h)
        for key in keys:
            value = known_scalar(h[key])
            if value is not None and not (0 <= value and (upper is None or value <= upper)):
                raise ValueError(f"Invalid {key} value: {h[key]}")
    return check


@dataclasses.dataclass(frozen=True)
class Rule:
    """One optimizer: what every kernel family and adapter reads about it.

    ``slots``: every state buffer the kernels know, in their ``s0, s1, s2`` order;
    ``buffers(h)``: the ones a configuration uses (a prefix-ordered subset). ``decay``: how
    weight decay applies ("l2" into the gradient, "decoupled" into the weight, "flag" by
    ``decoupled_weight_decay``, "none"). ``scalars(h, step, extra, xp)`` and ``numpy(c, p, g,
    b)``: the flat per-step scalars and NumPy elementwise update (None for rules without a
    flat kernel: their family computes its scalars itself; the CUDA per-element math of every
    rule is in ``xferlib/_kernels/rules.py``). ``families``: the kernel families that run the
    rule (:data:`FLAT`, :data:`TABLE`, :data:`TT`). TT runs a rule with the hyperparameters
    FBGEMM gives it (``lr``, ``eps``, ``betas``, ``weight_decay``, ``eta``, ``momentum``, the
    global ``step``: :func:`xferlib.tt.tt_sparse_update`), the others at their defaults: TT's
    ``sgd`` is torch's without momentum, its ``adagrad`` torch's without ``lr_decay``, weight
    decay or an initial accumulator."""

    name: str
    kind: OptId
    defaults: dict
    check: Callable
    slots: tuple
    buffers: Callable
    decay: str
    scalars: Callable | None = None
    numpy: Callable | None = None
    families: tuple = ()
    record: type | None = None  # the NamedTuple ``scalars`` returns (flat rules)

    def row(self, scalars) -> list:
        """``scalars`` (this rule's record) as the flat kernel's :data:`SCALARS` columns."""
        return list(scalars) + [0.0] * (SCALARS - len(scalars))

    def read_row(self, row):
        """The record in the first columns of a scalar-table row (``row[COMMON:]``)."""
        return self.record(*row[:len(self.record._fields)])

    @property
    def flat(self) -> bool:
        """Whether the flat kernel family (``xferlib.optim``) has this rule."""
        return self.numpy is not None


def _adam_buffers(h):
    return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if h["amsgrad"] else [])


def _rmsprop_buffers(h):
    return (["square_avg"] + (["momentum_buffer"] if h["momentum"] > 0 else [])
            + (["grad_avg"] if h["centered"] else []))


_ADAM_SLOTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# tt_sparse_update's defaults (every TT rule takes them; each reads the ones it uses)
_TT_DEFAULTS = dict(eps=1e-10, betas=(0.9, 0.999), weight_decay=0.0, eta=0.001, momentum=0.9)


def _tt_check(h):
    if h.get("lr", 0.0) < 0:
        raise ValueError(f"Invalid learning rate: {h['lr']}")

RULES = {r.name: r for r in (
    Rule("sgd", OptId.SGD, dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                                nesterov=False, maximize=False),
         _sgd_check, ("momentum_buffer",),
         lambda h: ["momentum_buffer"] if h["momentum"] else [], "l2",
         _sgd_scalars, _sgd_numpy, families=(FLAT, TABLE, TT), record=SgdScalars),
    Rule("adam", OptId.ADAM, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  amsgrad=False, maximize=False),
         check_common, _ADAM_SLOTS, _adam_buffers, "l2", _adam_scalars, _adam_numpy,
         families=(FLAT, TABLE), record=AdamScalars),
    Rule("adamw", OptId.ADAM, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                                   amsgrad=False, maximize=False),
         check_common, _ADAM_SLOTS, _adam_buffers, "decoupled", _adam_scalars, _adam_numpy,
         families=(FLAT, TABLE), record=AdamScalars),
    Rule("adagrad", OptId.ADAGRAD, dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                                        initial_accumulator_value=0.0, eps=1e-10,
                                        maximize=False),
         _adagrad_check, ("sum",), lambda h: ["sum"], "l2", _adagrad_scalars, _adagrad_numpy,
         families=(FLAT, TABLE, TT), record=AdagradScalars),
    Rule("rmsprop", OptId.RMSPROP, dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0,
                                        momentum=0.0, centered=False, maximize=False),
         _rmsprop_check, ("square_avg", "momentum_buffer", "grad_avg"), _rmsprop_buffers, "l2",
         _rmsprop_scalars, _rmsprop_numpy, families=(FLAT, TABLE), record=RmspropScalars),
    Rule("adamax", OptId.ADAMAX, dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                      maximize=False),
         check_common, ("exp_avg", "exp_inf"), lambda h: ["exp_avg", "exp_inf"], "l2",
         _adamax_scalars, _adamax_numpy, families=(FLAT, TABLE), record=AdamaxScalars),
    Rule("nadam", OptId.NADAM, dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                    momentum_decay=4e-3, decoupled_weight_decay=False,
                                    maximize=False),
         _nadam_check, ("exp_avg", "exp_avg_sq"), lambda h: ["exp_avg", "exp_avg_sq"], "flag",
         _nadam_scalars, _nadam_numpy, families=(FLAT,), record=NadamScalars),
    Rule("radam", OptId.RADAM, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                    decoupled_weight_decay=False, maximize=False),
         check_common, ("exp_avg", "exp_avg_sq"), lambda h: ["exp_avg", "exp_avg_sq"], "flag",
         _radam_scalars, _radam_numpy, families=(FLAT,), record=RadamScalars),
    Rule("lion", OptId.LION, dict(learning_rate=1e-4, b1=0.9, b2=0.99, weight_decay=1e-3),
         check_common, ("exp_avg",), lambda h: ["exp_avg"], "none", _lion_scalars, _lion_numpy,
         families=(FLAT,), record=LionScalars),
    # No flat kernel: host tables' row math lives in xferlib/table/rules.py and its kernels,
    # TT's in xferlib/tt/rules.py and its kernels.
    # FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row (a row scalar, not a slot).
    Rule("rowwise_adagrad", OptId.ROWWISE_ADAGRAD,
         dict(lr=1e-2, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-8,
              maximize=False),
         _range_check("initial_accumulator_value"), (), lambda h: [], "l2",
         families=(TABLE, TT)),
    Rule("adadelta", OptId.ADADELTA, dict(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0,
                                          maximize=False),
         _range_check("rho", upper=1.0), ("square_avg", "acc_delta"),
         lambda h: ["square_avg", "acc_delta"], "l2", families=(TABLE,)),
    # FBGEMM's rules of these names, TT only; their defaults are tt_sparse_update's (lr has
    # none), their state xferlib.tt.rules.STATE_SLOTS'.
    Rule("rowwise_adam", OptId.ROWWISE_ADAM, dict(_TT_DEFAULTS), _tt_check,
         ("exp_avg", "exp_avg_sq", "step"), lambda h: ["exp_avg", "exp_avg_sq", "step"], "l2",
         families=(TT,)),
    Rule("lamb", OptId.LAMB, dict(_TT_DEFAULTS), _tt_check, ("exp_avg", "exp_avg_sq"),
         lambda h: ["exp_avg", "exp_avg_sq"], "l2", families=(TT,)),
    Rule("lars_sgd", OptId.LARS_SGD, dict(_TT_DEFAULTS), _tt_check, ("momentum",),
         lambda h: ["momentum"], "l2", families=(TT,)),
    Rule("partial_rowwise_adam", OptId.PARTIAL_ROWWISE_ADAM, dict(_TT_DEFAULTS), _tt_check,
         ("exp_avg", "exp_avg_sq"), lambda h: ["exp_avg", "exp_avg_sq"], "l2",
         families=(TT,)),
    Rule("partial_rowwise_lamb", OptId.PARTIAL_ROWWISE_LAMB, dict(_TT_DEFAULTS), _tt_check,
         ("exp_avg", "exp_avg_sq"), lambda h: ["exp_avg", "exp_avg_sq"], "l2",
         families=(TT,)),
)}


def optimizers_for(family: str) -> tuple:
    """The names of the rules ``family`` (:data:`FLAT`, :data:`TABLE` or :data:`TT`) runs, in
    :data:`RULES` order: each family's list is a part of the one vocabulary.

    >>> optimizers_for(TT)[:3]
    ('sgd', 'adagrad', 'rowwise_adagrad')
    """
    if family not in (FLAT, TABLE, TT):
        raise ValueError(f"unknown kernel family {family!r}; one of {(FLAT, TABLE, TT)}")
    return tuple(name for name, r in RULES.items() if family in r.families)


FLAT_RULES = {name: RULES[name] for name in optimizers_for(FLAT)}
OPTIMIZERS = tuple(FLAT_RULES)


def get_rule(name: str, family: dict | None = None, what: str = "optimizer") -> Rule:
    """The rule called ``name`` among ``family`` (default: every rule); an unknown name is a
    ValueError naming the choices, the one error every family raises for it."""
    family = RULES if family is None else family
    try:
        return family[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {what} {name!r}; known: {sorted(family)}") from None


def common_scalars(rule: Rule, h: dict) -> list:
    """sign (-1 for maximize), L2 coefficient, decoupled decay factor: how torch applies
    maximize and weight decay before ``rule`` (works on traced jnp values too)."""
    sign = -1.0 if h.get("maximize", False) else 1.0
    wd = h.get("weight_decay", 0.0)
    decoupled = rule.decay == "decoupled" or (rule.decay == "flag"
                                               and h["decoupled_weight_decay"])
    if rule.decay == "none" or not wd:
        return [sign, 0.0, 1.0]
    if decoupled:
        return [sign, 0.0, 1.0 - h["lr"] * wd]
    return [sign, wd, 1.0]


def preamble_numpy(common, p, g):
    """maximize and weight decay, as torch applies them before each rule."""
    sign, l2, decay = common
    if sign < 0:
        g = -g
    if decay != 1.0:
        p *= _f32(decay)
    if l2:
        g = g + _f32(l2) * p
    return g


def resolve_hyper(name: str, overrides: dict | None = None) -> dict:
    """Flat optimizer ``name``'s defaults updated by ``overrides``, checked (ValueError as
    torch raises)."""
    r = get_rule(name, FLAT_RULES, "flat optimizer")
    unknown = set(overrides or ()) - set(r.defaults)
    if unknown:
        raise ValueError(f"{name}: unknown hyperparameter(s) {sorted(unknown)}; "
                         f"known: {sorted(r.defaults)}")
    h = {**r.defaults, **(overrides or {})}
    r.check(h)
    return h
