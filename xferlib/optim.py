"""Flat-buffer optimizers: every parameter in one buffer, one update over all of it.

A :class:`FlatLayout` places many tensors (*segments*) in one flat array, each starting on a
16-byte boundary, each tagged with its parameter group. An optimizer is a pair of functions,
optax style::

    layout = xferlib.optim.FlatLayout.from_shapes([(128, 64), (64,)])
    params, grads = layout.pack([w, b]), layout.zeros()
    opt = xferlib.optim.adam(lr=1e-3)
    state = opt.init(layout)                          # zeroed state buffers, step counters
    state = opt.update(layout, params, grads, state)  # params updated in place

``params`` and ``grads`` are flat arrays laid out by ``layout`` (NumPy on the CPU, CuPy on the
GPU); the state buffers are flat arrays of the same layout. The update rules, hyperparameter
names and defaults are torch.optim's (optax's for :func:`lion`), eps placement and bias
correction included, so a flat optimizer follows the torch optimizer it replaces step for
step.

Per-step scalars (bias corrections, step sizes, NAdam's momentum products) are computed on
the host per segment, from each segment's own step counter (a segment without a gradient in a
step is skipped, as torch skips a parameter whose ``.grad`` is None); the elementwise work then
runs in one pass: vectorized NumPy over runs of segments that share their scalars, or one CUDA
launch over the whole buffer (``xferlib/_kernels/optim.py``) with a per-segment scalar table.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, NamedTuple, Sequence

import numpy as np

from xferlib._backend import array_module, is_cupy_array

__all__ = [
    "Segment",
    "FlatLayout",
    "FlatState",
    "FlatOptimizer",
    "OPTIMIZERS",
    "sgd",
    "adam",
    "adamw",
    "adagrad",
    "rmsprop",
    "adamax",
    "nadam",
    "radam",
    "lion",
    "global_norm",
    "partial_norm",
    "clip_coefficient",
    "clip_by_global_norm",
    "apply_table",
    "apply_adam_device_scalars",
    "adam_device_hyper",
    "resolve_hyper",
    "fill_step_table",
    "CudaStep",
    "TableRing",
]

ALIGN_BYTES = 16  # every segment starts on a 16-byte boundary: whole-vector kernel accesses


# ----------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class Segment:
    """One tensor inside the flat buffer."""

    offset: int  # in elements
    size: int
    shape: tuple
    group: int


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each tensor lives in one flat buffer of ``total`` elements of ``dtype``."""

    segments: tuple
    total: int
    dtype: np.dtype

    @classmethod
    def from_shapes(cls, shapes, groups=None, dtype=np.float32) -> "FlatLayout":
        """Lay out tensors of ``shapes`` (with ``groups`` ids, default all 0) in order, each
        padded to a 16-byte boundary."""
        dtype = np.dtype(dtype)
        shapes = [tuple(int(d) for d in s) for s in shapes]
        groups = [0] * len(shapes) if groups is None else [int(g) for g in groups]
        if len(groups) != len(shapes):
            raise ValueError(f"{len(shapes)} shapes but {len(groups)} group ids")
        if any(g < 0 for g in groups):
            raise ValueError(f"group ids must be >= 0, got {min(groups)}")
        align = max(1, ALIGN_BYTES // dtype.itemsize)
        segments, offset = [], 0
        for shape, group in zip(shapes, groups):
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in shape {shape}")
            size = math.prod(shape)
            segments.append(Segment(offset, size, shape, group))
            offset += -(-size // align) * align
        return cls(tuple(segments), offset, dtype)

    @property
    def num_groups(self) -> int:
        cached = self.__dict__.get("_num_groups")
        if cached is None:
            cached = 1 + max((s.group for s in self.segments), default=-1)
            object.__setattr__(self, "_num_groups", cached)
        return cached

    @property
    def group_ids(self) -> np.ndarray:
        """The group of each segment, as an array (cached)."""
        cached = self.__dict__.get("_group_ids")
        if cached is None:
            cached = np.array([s.group for s in self.segments], dtype=np.int64)
            object.__setattr__(self, "_group_ids", cached)
        return cached

    def empty(self, xp=np):
        return xp.empty(self.total, dtype=self.dtype)

    def zeros(self, xp=np):
        return xp.zeros(self.total, dtype=self.dtype)

    def views(self, flat) -> list:
        """One view per segment, shaped as the tensor, sharing memory with ``flat``."""
        self.check(flat, "flat")
        return [flat[s.offset:s.offset + s.size].reshape(s.shape) for s in self.segments]

    def pack(self, arrays, out=None):
        """Copy ``arrays`` (one per segment) into a flat buffer (padding zeroed)."""
        arrays = list(arrays)
        if len(arrays) != len(self.segments):
            raise ValueError(f"{len(arrays)} arrays for {len(self.segments)} segments")
        xp = array_module(arrays[0]) if arrays else np
        flat = self.zeros(xp) if out is None else out
        for seg, a in zip(self.segments, arrays):
            if tuple(a.shape) != seg.shape:
                raise ValueError(f"array of shape {tuple(a.shape)} for a segment of {seg.shape}")
            flat[seg.offset:seg.offset + seg.size] = a.reshape(-1)
        return flat

    def check(self, flat, name: str) -> None:
        if flat.ndim != 1 or flat.shape[0] != self.total:
            raise ValueError(f"{name} must be a flat array of {self.total} elements, got shape "
                             f"{tuple(flat.shape)}")
        if flat.dtype != self.dtype:
            raise TypeError(f"{name} dtype {flat.dtype} does not match the layout's {self.dtype}")


# ----------------------------------------------------------------------------- state


class FlatState(NamedTuple):
    """Optimizer state: flat buffers by torch's state names, and per-segment scalars.

    ``steps``: int64 step count per segment (torch's ``state['step']``). ``scalars``: other
    per-segment host scalars by name (NAdam's ``mu_product``).
    """

    buffers: dict
    steps: np.ndarray
    scalars: dict


@dataclasses.dataclass(frozen=True)
class FlatOptimizer:
    """An ``(init, update)`` pair with the metadata adapters need."""

    name: str
    defaults: dict
    init: Callable
    update: Callable
    state_names: Callable  # hyper -> names of the flat state buffers
    kind: int  # the kernel's optimizer id


# ----------------------------------------------------------------------------- the rules
#
# Each rule has three parts: a hyperparameter check, per-segment scalars (host, float64, from
# the segment's step count) and the elementwise update (NumPy here; CUDA in
# xferlib/_kernels/optim.py). Before the rule runs, the gradient is negated for ``maximize`` and
# weight decay is applied the way torch applies it for that optimizer: added to the gradient
# (L2) or multiplied into the parameter (decoupled, AdamW-style). Elementwise code follows
# torch's op order so the float32 results track torch's.

SCALARS = 8  # rule-specific scalars per segment
COMMON = 3  # sign, L2 coefficient, decoupled decay factor


def _check_common(h: dict) -> None:
    lr = h.get("lr", h.get("learning_rate"))
    if not isinstance(lr, (int, float)) or not lr >= 0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if h.get("weight_decay", 0.0) < 0:
        raise ValueError(f"Invalid weight_decay value: {h['weight_decay']}")
    if h.get("eps", 0.0) < 0:
        raise ValueError(f"Invalid epsilon value: {h['eps']}")
    if "betas" in h:
        b1, b2 = h["betas"]
        if not 0.0 <= b1 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {b1}")
        if not 0.0 <= b2 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {b2}")


def _check_nonnegative(h: dict, *keys) -> None:
    _check_common(h)
    for key in keys:
        if h[key] < 0:
            raise ValueError(f"Invalid {key} value: {h[key]}")


def _f32(x) -> np.float32:
    return np.float32(x)


def _sgd_check(h):
    _check_nonnegative(h, "momentum", "dampening")
    if h["nesterov"] and (h["momentum"] <= 0 or h["dampening"] != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def _sgd_scalars(h, step, extra):
    first = step == 1  # torch's first step copies the gradient into the momentum buffer
    keep = 0.0 if first else h["momentum"]
    take = 1.0 if first else 1.0 - h["dampening"]
    return [h["lr"], h["momentum"], keep, take, float(h["momentum"] != 0),
            float(h["nesterov"]), 0.0, 0.0]


def _sgd_numpy(c, p, g, b):
    lr, mom, keep, take, use_momentum, nesterov = c[:6]
    if use_momentum:
        buf = b["momentum_buffer"]
        buf *= _f32(keep)
        buf += _f32(take) * g
        g = g + _f32(mom) * buf if nesterov else buf
    p -= _f32(lr) * g


def _adam_scalars(h, step, extra):
    b1, b2 = h["betas"]
    bc1 = 1.0 - b1 ** step
    return [h["lr"] / bc1, b1, b2, h["eps"], math.sqrt(1.0 - b2 ** step),
            float(h["amsgrad"]), 0.0, 0.0]


def _adam_numpy(c, p, g, b):
    step_size, b1, b2, eps, bc2_sqrt, amsgrad = c[:6]
    m, v = b["exp_avg"], b["exp_avg_sq"]
    m += (g - m) * _f32(1.0 - b1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
    v *= _f32(b2)
    v += _f32(1.0 - b2) * g * g
    if amsgrad:
        np.maximum(b["max_exp_avg_sq"], v, out=b["max_exp_avg_sq"])
        v = b["max_exp_avg_sq"]
    denom = np.sqrt(v) / _f32(bc2_sqrt) + _f32(eps)
    p -= _f32(step_size) * (m / denom)


def _adagrad_check(h):
    _check_nonnegative(h, "lr_decay", "initial_accumulator_value")


def _adagrad_scalars(h, step, extra):
    return [h["lr"] / (1.0 + (step - 1) * h["lr_decay"]), h["eps"], 0, 0, 0, 0, 0, 0]


def _adagrad_numpy(c, p, g, b):
    clr, eps = c[:2]
    s = b["sum"]
    s += g * g
    p -= _f32(clr) * (g / (np.sqrt(s) + _f32(eps)))


def _rmsprop_check(h):
    _check_nonnegative(h, "momentum", "alpha")


def _rmsprop_scalars(h, step, extra):
    return [h["lr"], h["alpha"], h["eps"], h["momentum"], float(h["centered"]), 0, 0, 0]


def _rmsprop_numpy(c, p, g, b):
    lr, alpha, eps, mom, centered = c[:5]
    sq = b["square_avg"]
    sq *= _f32(alpha)
    sq += _f32(1.0 - alpha) * g * g
    if centered:
        ga = b["grad_avg"]
        ga += (g - ga) * _f32(1.0 - alpha)
        avg = np.sqrt(sq - ga * ga) + _f32(eps)
    else:
        avg = np.sqrt(sq) + _f32(eps)
    if mom > 0:
        buf = b["momentum_buffer"]
        buf *= _f32(mom)
        buf += g / avg
        p -= _f32(lr) * buf
    else:
        p -= _f32(lr) * (g / avg)


def _adamax_scalars(h, step, extra):
    b1, b2 = h["betas"]
    return [h["lr"] / (1.0 - b1 ** step), b1, b2, h["eps"], 0, 0, 0, 0]


def _adamax_numpy(c, p, g, b):
    clr, b1, b2, eps = c[:4]
    m, u = b["exp_avg"], b["exp_inf"]
    m += (g - m) * _f32(1.0 - b1)
    np.maximum(u * _f32(b2), np.abs(g) + _f32(eps), out=u)
    p -= _f32(clr) * (m / u)


def _nadam_check(h):
    _check_nonnegative(h, "momentum_decay")


def _nadam_scalars(h, step, extra):
    b1, b2 = h["betas"]
    mu = b1 * (1.0 - 0.5 * 0.96 ** (step * h["momentum_decay"]))
    mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * h["momentum_decay"]))
    mu_product = extra["mu_product"] * mu
    extra["mu_product"] = mu_product  # stored back per segment by the caller
    return [-h["lr"] * (1.0 - mu) / (1.0 - mu_product),
            -h["lr"] * mu_next / (1.0 - mu_product * mu_next),
            b1, b2, 1.0 - b2 ** step, h["eps"], 0, 0]


def _nadam_numpy(c, p, g, b):
    coef_grad, coef_avg, b1, b2, bc2, eps = c[:6]
    m, v = b["exp_avg"], b["exp_avg_sq"]
    m += (g - m) * _f32(1.0 - b1)
    v *= _f32(b2)
    v += _f32(1.0 - b2) * g * g
    denom = np.sqrt(v / _f32(bc2)) + _f32(eps)
    p += _f32(coef_grad) * (g / denom)
    p += _f32(coef_avg) * (m / denom)


def _radam_scalars(h, step, extra):
    b1, b2 = h["betas"]
    bc1 = 1.0 - b1 ** step
    bc2 = 1.0 - b2 ** step
    rho_inf = 2.0 / (1.0 - b2) - 1.0
    rho_t = rho_inf - 2.0 * step * (b2 ** step) / bc2
    if rho_t > 5.0:  # variance is tractable: rectified adaptive step
        rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf
                         / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        return [h["lr"] / bc1, b1, b2, h["eps"], math.sqrt(bc2), rect, 1.0, 0.0]
    return [h["lr"] / bc1, b1, b2, h["eps"], math.sqrt(bc2), 0.0, 0.0, 0.0]


def _radam_numpy(c, p, g, b):
    lr_bc1, b1, b2, eps, bc2_sqrt, rect, rectified = c[:7]
    m, v = b["exp_avg"], b["exp_avg_sq"]
    m += (g - m) * _f32(1.0 - b1)
    v *= _f32(b2)
    v += _f32(1.0 - b2) * g * g
    if rectified:
        adaptive = _f32(bc2_sqrt) / (np.sqrt(v) + _f32(eps))
        p -= _f32(lr_bc1) * m * adaptive * _f32(rect)
    else:
        p -= _f32(lr_bc1) * m


def _lion_scalars(h, step, extra):
    return [h["learning_rate"], h["b1"], h["b2"], h["weight_decay"], 0, 0, 0, 0]


def _lion_numpy(c, p, g, b):
    # optax.lion: update = sign(b1 m + (1 - b1) g) + wd p;  m <- b2 m + (1 - b2) g
    lr, b1, b2, wd = c[:4]
    m = b["exp_avg"]
    update = np.sign(_f32(b1) * m + _f32(1.0 - b1) * g)
    m *= _f32(b2)
    m += _f32(1.0 - b2) * g
    if wd:
        update += _f32(wd) * p
    p -= _f32(lr) * update


@dataclasses.dataclass(frozen=True)
class _Rule:
    kind: int
    defaults: dict
    check: Callable
    scalars: Callable
    numpy: Callable
    buffers: Callable  # hyper -> state buffer names
    decay: str  # "l2", "decoupled", "flag" (decoupled_weight_decay), or "none"


_RULES = {
    "sgd": _Rule(0, dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                         nesterov=False, maximize=False),
                 _sgd_check, _sgd_scalars, _sgd_numpy,
                 lambda h: ["momentum_buffer"] if h["momentum"] else [], "l2"),
    "adam": _Rule(1, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                          amsgrad=False, maximize=False),
                  _check_common, _adam_scalars, _adam_numpy,
                  lambda h: ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if h["amsgrad"]
                                                         else []), "l2"),
    "adamw": _Rule(1, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                           amsgrad=False, maximize=False),
                   _check_common, _adam_scalars, _adam_numpy,
                   lambda h: ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if h["amsgrad"]
                                                          else []), "decoupled"),
    "adagrad": _Rule(2, dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                             initial_accumulator_value=0.0, eps=1e-10, maximize=False),
                     _adagrad_check, _adagrad_scalars, _adagrad_numpy, lambda h: ["sum"], "l2"),
    "rmsprop": _Rule(3, dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                             centered=False, maximize=False),
                     _rmsprop_check, _rmsprop_scalars, _rmsprop_numpy,
                     lambda h: ["square_avg"] + (["momentum_buffer"] if h["momentum"] > 0
                                                 else []) + (["grad_avg"] if h["centered"]
                                                             else []), "l2"),
    "adamax": _Rule(4, dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            maximize=False),
                    _check_common, _adamax_scalars, _adamax_numpy,
                    lambda h: ["exp_avg", "exp_inf"], "l2"),
    "nadam": _Rule(5, dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                           momentum_decay=4e-3, decoupled_weight_decay=False, maximize=False),
                   _nadam_check, _nadam_scalars, _nadam_numpy,
                   lambda h: ["exp_avg", "exp_avg_sq"], "flag"),
    "radam": _Rule(6, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                           decoupled_weight_decay=False, maximize=False),
                   _check_common, _radam_scalars, _radam_numpy,
                   lambda h: ["exp_avg", "exp_avg_sq"], "flag"),
    "lion": _Rule(7, dict(learning_rate=1e-4, b1=0.9, b2=0.99, weight_decay=1e-3),
                  _check_common, _lion_scalars, _lion_numpy, lambda h: ["exp_avg"], "none"),
}

OPTIMIZERS = tuple(_RULES)


def _common_scalars(rule: _Rule, h: dict) -> list:
    sign = -1.0 if h.get("maximize", False) else 1.0
    wd = h.get("weight_decay", 0.0)
    decoupled = rule.decay == "decoupled" or (rule.decay == "flag"
                                               and h["decoupled_weight_decay"])
    if rule.decay == "none" or not wd:
        return [sign, 0.0, 1.0]
    if decoupled:
        return [sign, 0.0, 1.0 - h["lr"] * wd]
    return [sign, wd, 1.0]


def _preamble_numpy(common, p, g):
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
    """``name``'s defaults updated by ``overrides``, checked (ValueError as torch raises)."""
    if name not in _RULES:
        raise ValueError(f"unknown flat optimizer {name!r}; known: {sorted(_RULES)}")
    rule = _RULES[name]
    unknown = set(overrides or ()) - set(rule.defaults)
    if unknown:
        raise ValueError(f"{name}: unknown hyperparameter(s) {sorted(unknown)}; "
                         f"known: {sorted(rule.defaults)}")
    h = {**rule.defaults, **(overrides or {})}
    rule.check(h)
    return h


def _make(name: str):
    rule = _RULES[name]

    def factory(**hyper) -> FlatOptimizer:
        defaults = resolve_hyper(name, hyper)

        def state_names(h=None):
            return rule.buffers(defaults if h is None else h)

        def init(layout: FlatLayout, hypers: Sequence[dict] | None = None, xp=None):
            """Zeroed state for ``layout`` (``xp``: numpy or cupy; default numpy)."""
            xp = np if xp is None else xp
            hypers = _group_hypers(layout, hypers, defaults, name)
            names = []
            for h in hypers:
                names += [n for n in rule.buffers(h) if n not in names]
            buffers = {n: layout.zeros(xp) for n in names}
            if name == "adagrad":
                for seg in layout.segments:
                    value = hypers[seg.group]["initial_accumulator_value"]
                    buffers["sum"][seg.offset:seg.offset + seg.size] = value
            scalars = {"mu_product": np.ones(len(layout.segments))} if name == "nadam" else {}
            return FlatState(buffers, np.zeros(len(layout.segments), dtype=np.int64), scalars)

        def update(layout: FlatLayout, params, grads, state: FlatState,
                   hypers: Sequence[dict] | None = None, active=None, stream=None,
                   params_lowp=None) -> FlatState:
            """One step in place on ``params`` and ``state``; returns ``state``.

            ``hypers``: one dict per group (default: this optimizer's hyperparameters).
            ``active``: bool per segment; inactive segments (no gradient) are skipped and
            their step counters stay. Mixed precision: ``params`` are the float32 master
            weights, ``grads`` may be bfloat16 or float16, and ``params_lowp`` (the model's
            low-precision copy, same dtype as ``grads``) receives the updated weights rounded.
            """
            layout.check(params, "params")
            _check_grads(layout, grads, "grads")
            if params_lowp is not None:
                _check_grads(layout, params_lowp, "params_lowp")
            hypers = _group_hypers(layout, hypers, defaults, name)
            active = (np.ones(len(layout.segments), dtype=bool) if active is None
                      else np.asarray(active, dtype=bool))
            if active.shape != (len(layout.segments),):
                raise ValueError(f"active must have one flag per segment "
                                 f"({len(layout.segments)}), got shape {active.shape}")
            table = step_scalars(rule, layout, state, hypers, active)
            apply_table(name, layout, params, grads, state.buffers, table, stream=stream,
                        params_lowp=params_lowp)
            return state

        return FlatOptimizer(name, defaults, init, update, state_names, rule.kind)

    factory.__name__ = name
    factory.__qualname__ = name
    factory.__doc__ = (f"Flat {name}: torch.optim's rule, names and defaults "
                       f"{_RULES[name].defaults}." if name != "lion" else
                       f"Flat lion: optax.lion's rule, names and defaults "
                       f"{_RULES[name].defaults}.")
    return factory


def _group_hypers(layout, hypers, defaults, name):
    if hypers is None:
        hypers = [defaults] * max(1, layout.num_groups)
    hypers = list(hypers)
    if len(hypers) < layout.num_groups:
        raise ValueError(f"layout has {layout.num_groups} groups but {len(hypers)} "
                         "hyperparameter dicts were given")
    return hypers


def step_scalars(rule: _Rule, layout: FlatLayout, state: FlatState, hypers, active):
    """Advance the step counters of active segments and return the per-segment scalar table
    (float64, ``COMMON + SCALARS`` columns; rows of inactive segments are zero).

    Scalars are computed once per group and distinct step (segments of a group usually share
    their step), so the host cost does not grow with the number of tensors."""
    if _is_uniform(state, active):
        return _uniform_rows(rule, layout, state, hypers)[layout.group_ids]
    return _mixed_step_scalars(rule, layout, state, hypers, active)


def fill_step_table(rule: _Rule, layout: FlatLayout, state: FlatState, hypers, active,
                    out) -> None:
    """:func:`step_scalars` written into ``out`` (a ``(segments, COMMON + SCALARS)`` float32
    array, e.g. pinned staging memory). The common case (every segment steps, all at the same
    count) computes one row per group and allocates nothing per step."""
    if _is_uniform(state, active):
        rows = _uniform_rows(rule, layout, state, hypers)
        if len(rows) == 1:
            out[...] = rows[0]  # broadcast: one group
        else:
            out[...] = rows[layout.group_ids]
        return
    out[...] = _mixed_step_scalars(rule, layout, state, hypers, active)


def _is_uniform(state, active) -> bool:
    steps = state.steps
    return bool(active.all()) and (len(steps) == 0 or steps.min() == steps.max())


def _mixed_step_scalars(rule, layout, state, hypers, active):
    table = np.zeros((len(layout.segments), COMMON + SCALARS))
    state.steps[active] += 1
    groups = layout.group_ids
    for group, h in enumerate(hypers[:max(1, layout.num_groups)]):
        selected = np.flatnonzero(active & (groups == group))
        if selected.size == 0:
            continue
        common = _common_scalars(rule, h)
        keys = [state.steps[selected]] + [state.scalars[k][selected] for k in state.scalars]
        unique, inverse = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)
        rows = np.empty((len(unique), COMMON + SCALARS))
        new_extra = {k: np.empty(len(unique)) for k in state.scalars}
        for u, key in enumerate(unique):
            extra = dict(zip(state.scalars, key[1:]))
            rows[u, :COMMON] = common
            rows[u, COMMON:] = rule.scalars(h, int(key[0]), extra)
            for k in state.scalars:
                new_extra[k][u] = extra[k]
        inverse = inverse.reshape(-1)
        table[selected] = rows[inverse]
        for k in state.scalars:
            state.scalars[k][selected] = new_extra[k][inverse]
    return table


def _uniform_rows(rule, layout, state, hypers):
    """The common case: every segment steps, all at the same count. One row per group
    (``rows[layout.group_ids]`` is the per-segment table)."""
    step = int(state.steps[0]) + 1 if len(state.steps) else 1
    state.steps[...] += 1
    groups = layout.group_ids
    rows = np.zeros((max(1, layout.num_groups), COMMON + SCALARS))
    single = len(rows) == 1
    for group in range(len(rows)):
        members = slice(None) if single else groups == group
        first = 0 if single else np.flatnonzero(members)
        if not single:
            if first.size == 0:
                continue
            first = int(first[0])
        h = hypers[group]
        extra = {k: v[first] for k, v in state.scalars.items()}
        rows[group, :COMMON] = _common_scalars(rule, h)
        rows[group, COMMON:] = rule.scalars(h, step, extra)
        for k, v in extra.items():
            state.scalars[k][members] = v
    return rows


def _update_numpy(rule, layout, params, grads, buffers, table):
    # Runs of adjacent active segments that share every scalar update as one slice.
    segments = layout.segments
    active = table[:, 0] != 0
    i = 0
    while i < len(segments):
        if not active[i]:
            i += 1
            continue
        j = i + 1
        while j < len(segments) and active[j] and np.array_equal(table[j], table[i]):
            j += 1
        start = segments[i].offset
        end = segments[j].offset if j < len(segments) else layout.total
        p = params[start:end]
        g = _preamble_numpy(table[i, :COMMON], p, grads[start:end])
        rule.numpy(table[i, COMMON:], p, g, {n: b[start:end] for n, b in buffers.items()})
        i = j


def apply_table(name: str, layout: FlatLayout, params, grads, buffers: dict, table, *,
                updates=None, stream=None, params_lowp=None) -> None:
    """The elementwise half of a step, given the per-segment scalar table.

    ``table``: ``(segments, COMMON + SCALARS)``, a host array (copied to the GPU for the CUDA
    path) or, on the GPU, a device array already there (the JAX adapter computes it inside
    ``jit``). A row whose sign is 0 skips its segment. With ``updates``, ``params`` stay as
    they are and ``updates`` receives the step (new - old), optax's convention; ``updates`` may
    be ``grads`` itself.
    """
    rule = _RULES[name]
    if is_cupy_array(params):
        _update_cuda(rule, layout, params, grads, buffers, table, updates, stream, params_lowp)
        return
    if grads.dtype != np.float32:
        grads = grads.astype(np.float32)
    if updates is None:
        _update_numpy(rule, layout, params, grads, buffers, table)
        if params_lowp is not None:
            params_lowp[...] = params.astype(params_lowp.dtype)
        return
    new = params.copy()
    _update_numpy(rule, layout, new, grads, buffers, table)
    np.subtract(new, params, out=updates)


def adam_device_hyper(name: str, h: dict) -> list:
    """One group's row for :func:`apply_adam_device_scalars`: lr, beta1, beta2, eps,
    weight_decay, decoupled, amsgrad, maximize."""
    if name not in ("adam", "adamw"):
        raise ValueError(f"device-side step scalars exist for adam and adamw, not {name}")
    b1, b2 = h["betas"]
    return [h["lr"], b1, b2, h["eps"], h["weight_decay"], float(name == "adamw"),
            float(h["amsgrad"]), float(h["maximize"])]


def apply_adam_device_scalars(layout: FlatLayout, params, grads, buffers: dict, hyper,
                              segment_groups, steps, active, *, stream=None,
                              params_lowp=None, grad_mul=None, grad_scale=None,
                              found_inf=None) -> None:
    """An Adam/AdamW step whose scalars are computed on the GPU from device-resident state.

    ``hyper``: float32 ``(groups, 8)`` rows of :func:`adam_device_hyper`; ``segment_groups``:
    int32 group per segment; ``steps``: float32 step count per segment (advanced here for
    active segments); ``active``: uint8 per segment. All CuPy arrays: nothing crosses from the
    host, so the two launches can be captured in a CUDA graph and replayed.

    Optional float32 one-element device arrays, read by the kernel: ``grad_mul`` multiplies
    the gradients (a clipping factor from :func:`global_norm_clip_factor`); ``grad_scale``
    divides them (a loss scale); ``found_inf`` != 0 skips the step entirely: parameters,
    state and step counts stay as they are (GradScaler's contract).
    """
    from xferlib._backend import as_cupy_stream
    from xferlib._kernels.optim import OPTIM_MODULE, device_scalars_name

    layout.check(params, "params")
    _check_grads(layout, grads, "grads")
    for name in ("exp_avg", "exp_avg_sq"):
        layout.check(buffers[name], name)
    n = len(layout.segments)
    if steps.shape != (n,) or active.shape != (n,) or segment_groups.shape != (n,):
        raise ValueError(f"steps, active and segment_groups need one entry per segment ({n})")
    stream = as_cupy_stream(stream)
    chunks = _chunk_table(layout)
    grad_dtype = np.dtype(grads.dtype).name
    vmax = buffers.get("max_exp_avg_sq")
    with stream:
        kernel = OPTIM_MODULE.get_function(device_scalars_name(grad_dtype))
        kernel((len(chunks[0]),), (256,),
               (params, grads, buffers["exp_avg"], buffers["exp_avg_sq"],
                np.uint64(0) if vmax is None else vmax, hyper, segment_groups, steps, active,
                *chunks, _or_null(params_lowp), _or_null(grad_mul), _or_null(grad_scale),
                _or_null(found_inf)), stream=stream)
        advance = OPTIM_MODULE.get_function("advance_steps")
        advance((max(1, -(-n // 256)),), (256,), (steps, active, np.int32(n),
                                                  _or_null(found_inf)), stream=stream)


def _or_null(array):
    """A kernel argument: the array, or a null pointer for None."""
    return np.uint64(0) if array is None else array


def _check_grads(layout: FlatLayout, grads, name: str) -> None:
    """Gradients (and low-precision parameter copies): the layout's length, float32 or a
    16-bit float type."""
    if grads.ndim != 1 or grads.shape[0] != layout.total:
        raise ValueError(f"{name} must be a flat array of {layout.total} elements, got shape "
                         f"{tuple(grads.shape)}")
    if np.dtype(grads.dtype).name not in ("float32", "bfloat16", "float16"):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {grads.dtype}")


def _update_cuda(rule, layout, params, grads, buffers, table, updates, stream, params_lowp):
    """One launch over the whole buffer: a block per chunk of a segment, the segment's scalars
    from the table (inactive segments have a zero sign and exit)."""
    from xferlib._backend import as_cupy_stream
    from xferlib._kernels.optim import OPTIM_MODULE, slot_names, update_name

    stream = as_cupy_stream(stream)
    chunks = _chunk_table(layout)
    pointers = []
    for slot in slot_names(rule.kind):
        buffer = buffers.get(slot)
        if buffer is not None:
            layout.check(buffer, slot)
        pointers.append(np.uint64(0) if buffer is None else buffer)
    pointers += [np.uint64(0)] * (3 - len(pointers))
    with stream:
        grad_dtype = np.dtype(grads.dtype).name
        if params_lowp is not None and np.dtype(params_lowp.dtype).name != grad_dtype:
            raise TypeError(f"params_lowp dtype {params_lowp.dtype} must match the gradients' "
                            f"{grads.dtype}")
        kernel = OPTIM_MODULE.get_function(update_name(rule.kind, grad_dtype))
        slot = None
        if is_cupy_array(table):
            device_table = table
        else:
            ring = _table_ring(layout, table.shape)
            slot = ring.acquire()
            slot.host[...] = table
            ring.upload(slot, stream)
            device_table = slot.device
        kernel((len(chunks[0]),), (256,),
               (params, grads, *pointers, device_table, *chunks, np.int32(table.shape[1]),
                np.uint64(0) if updates is None else updates,
                np.uint64(0) if params_lowp is None else params_lowp), stream=stream)
        if slot is not None:
            ring.release(slot, stream)


def _table_ring(layout, shape):
    import cupy

    cache = layout.__dict__.setdefault("_tables", {})
    key = (cupy.cuda.runtime.getDevice(), tuple(shape))
    ring = cache.get(key)
    if ring is None:
        ring = cache[key] = TableRing(shape)
    return ring


_RING_MAX = 256  # staging slots per table shape before the host waits for the GPU


class _Slot:
    __slots__ = ("block", "host", "device", "host_ptr", "device_ptr", "event", "args")

    def __init__(self, block, host, device):
        import cupy

        self.block = block  # the pinned allocation this slot's host view lives in
        self.host = host
        self.device = device
        self.host_ptr = host.ctypes.data
        self.device_ptr = device.data.ptr
        self.event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
        self.args = None  # a prepared launch's arguments with this slot's table (CudaStep)


class TableRing:
    """Pinned staging slots for a per-step scalar table, each with its device copy.

    A slot is reused only once the event recorded behind its last use has completed, so the
    host never overwrites a table the GPU has yet to copy or read. When every slot is still in
    flight (the host is running ahead of the GPU) slots are added rather than waited for,
    as many again as there are, in one pinned and one device allocation (pinning memory costs
    far more than a step), up to 256: a step's host path does not wait for the GPU in
    practice, where two slots used in turn made every step wait for the one before last (the
    eager step then ran at the GPU's pace, not the host's)."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.nbytes = int(np.prod(self.shape)) * 4
        self.free = []
        self.busy = collections.deque()
        self.count = 0

    def _grow(self) -> None:
        import cupy

        from xferlib.memory import pinned_empty

        k = min(max(4, self.count), _RING_MAX - self.count)
        block = pinned_empty((k, *self.shape), np.float32)
        host = np.asarray(block)  # plain ndarray views: cheaper to write into
        device = cupy.empty((k, *self.shape), dtype=np.float32)
        self.free += [_Slot(block, host[j], device[j]) for j in range(k)]
        self.count += k

    def acquire(self) -> _Slot:
        busy = self.busy
        while busy and busy[0].event.done:
            self.free.append(busy.popleft())
        if not self.free and self.count < _RING_MAX:
            self._grow()
        if self.free:
            return self.free.pop()
        slot = busy.popleft()
        slot.event.synchronize()
        return slot

    def upload(self, slot: _Slot, stream) -> None:
        """Queue the copy of ``slot.host`` to ``slot.device`` on ``stream`` (a CuPy stream)."""
        import cupy

        cupy.cuda.runtime.memcpyAsync(slot.device_ptr, slot.host_ptr, self.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)

    def release(self, slot: _Slot, stream) -> None:
        """After the launch that reads ``slot``: it is free again once ``stream`` gets here."""
        slot.event.record(stream)
        self.busy.append(slot)


class CudaStep:
    """One rule's flat update on the GPU over fixed buffers, prepared once for repeated steps.

    Everything a launch needs is resolved here (the kernel, the chunk table, the buffers' raw
    pointers, the argument tuple for each staging slot), so a step is: the scalar table
    written into pinned staging memory (:func:`fill_step_table`, one row per group in the
    common case), one small asynchronous host-to-device copy, one launch. No allocation, no
    DLPack exchange and no synchronization per step. The buffers must stay alive and in place
    (the torch adapter holds them).

    >>> # step = CudaStep("adam", layout, params, grads, state.buffers)   # CuPy arrays
    >>> # step(state, hypers, active, stream)                             # each step
    """

    def __init__(self, name: str, layout: FlatLayout, params, grads, buffers: dict,
                 params_lowp=None):
        import cupy

        from xferlib._kernels.optim import OPTIM_MODULE, slot_names, update_name

        rule = _RULES[name]
        layout.check(params, "params")
        _check_grads(layout, grads, "grads")
        grad_dtype = np.dtype(grads.dtype).name
        if params_lowp is not None:
            _check_grads(layout, params_lowp, "params_lowp")
            if np.dtype(params_lowp.dtype).name != grad_dtype:
                raise TypeError(f"params_lowp dtype {params_lowp.dtype} must match the "
                                f"gradients' {grads.dtype}")
        slots = []
        for slot in slot_names(rule.kind):
            buffer = buffers.get(slot)
            if buffer is not None:
                layout.check(buffer, slot)
            slots.append(buffer)
        slots += [None] * (3 - len(slots))
        self.rule, self.layout = rule, layout
        self.device = params.device.id
        with cupy.cuda.Device(self.device):
            chunks = _chunk_table(layout)
            self.kernel = OPTIM_MODULE.get_function(update_name(rule.kind, grad_dtype))
        self.grid, self.block = (len(chunks[0]),), (256,)
        self._keep = (params, grads, dict(buffers), params_lowp, chunks)  # pointers below
        self._head = tuple(_pointer(a) for a in (params, grads, *slots))
        self._tail = (*(_pointer(c) for c in chunks), np.int32(COMMON + SCALARS), np.uint64(0),
                      _pointer(params_lowp))
        self.ring = TableRing((len(layout.segments), COMMON + SCALARS))

    def __call__(self, state: FlatState, hypers, active, stream) -> None:
        """One step: ``hypers`` one dict per group, ``active`` bool per segment, ``stream`` a
        CuPy stream (``as_cupy_stream`` wraps torch's)."""
        ring = self.ring
        slot = ring.acquire()
        fill_step_table(self.rule, self.layout, state, hypers, active, slot.host)
        ring.upload(slot, stream)
        args = slot.args
        if args is None:
            args = slot.args = (*self._head, np.uint64(slot.device_ptr), *self._tail)
        self.kernel(self.grid, self.block, args, stream=stream)
        ring.release(slot, stream)


def _pointer(array):
    return np.uint64(0) if array is None else np.uint64(array.data.ptr)


_CHUNK = 8192  # elements per block


def _chunk_table(layout: FlatLayout):
    """(segment id, start, end) per block, cached per layout and device."""
    import cupy

    cache = layout.__dict__.setdefault("_chunks", {})
    device = cupy.cuda.runtime.getDevice()
    cached = cache.get(device)
    if cached is None:
        seg_ids, starts, ends = [], [], []
        for i, seg in enumerate(layout.segments):
            end = (layout.segments[i + 1].offset if i + 1 < len(layout.segments)
                   else layout.total)  # the padding rides along: it stays zero
            for start in range(seg.offset, end, _CHUNK):
                seg_ids.append(i)
                starts.append(start)
                ends.append(min(end, start + _CHUNK))
        cached = cache[device] = (cupy.asarray(np.array(seg_ids, dtype=np.int32)),
                                 cupy.asarray(np.array(starts, dtype=np.int64)),
                                 cupy.asarray(np.array(ends, dtype=np.int64)))
    return cached


sgd = _make("sgd")
adam = _make("adam")
adamw = _make("adamw")
adagrad = _make("adagrad")
rmsprop = _make("rmsprop")
adamax = _make("adamax")
nadam = _make("nadam")
radam = _make("radam")
lion = _make("lion")


# ----------------------------------------------------------------------------- clipping


def _partial_norm(grads, norm_type: float):
    """Per-buffer part of a global norm: max |g| (inf norm) or sum |g|^p, as a 0-d array."""
    xp = array_module(grads)
    g = grads.astype(xp.float32, copy=False)
    if norm_type == float("inf"):
        return xp.abs(g).max() if g.size else xp.zeros((), xp.float32)
    return xp.sum(xp.abs(g) ** norm_type)


def _total_norm(buffers, norm_type: float):
    """The norm over several flat buffers, as a 0-d array; no host sync unless the buffers
    live in different namespaces (NumPy and CuPy)."""
    partials = [_partial_norm(g, norm_type) for g in buffers]
    namespaces = {array_module(g) for g in buffers}
    xp = namespaces.pop() if len(namespaces) == 1 else np
    if xp is np:
        partials = [np.float32(float(v)) for v in partials]
    stacked = xp.stack([xp.asarray(v, dtype=xp.float32) for v in partials])
    if norm_type == float("inf"):
        return stacked.max()
    return stacked.sum() ** (1.0 / norm_type)


def partial_norm(grads, norm_type: float = 2.0):
    """One buffer's share of a global norm, a 0-d array where ``grads`` lives: ``sum |g|^p``
    (``max |g|`` for the inf norm). Shares of several buffers or processes combine by sum
    (max), then ``** (1 / p)``: how a sharded optimizer gets the norm of all gradients."""
    return _partial_norm(grads, float(norm_type))


def global_norm(grads, norm_type: float = 2.0) -> float:
    """The norm of all gradients in a flat buffer (padding is zero, so it does not count)."""
    return float(_total_norm([grads], norm_type))


def _stream_context(buffers, stream):
    from xferlib._backend import stream_scope

    return stream_scope(stream, any(is_cupy_array(g) for g in buffers))


def global_norm_clip_factor(buffers, max_norm: float, norm_type: float = 2.0,
                            eps: float = 1e-6, *, stream=None):
    """``(total_norm, factor)`` over flat gradient buffers, both computed where the buffers
    live (no host sync on the GPU): ``factor = min(1, max_norm / (total_norm + eps))``, as
    torch.nn.utils.clip_grad_norm_. The gradients are not touched: hand ``factor`` to a
    fused update (``apply_adam_device_scalars(grad_mul=...)``) to clip without a pass of
    its own, or use :func:`clip_by_global_norm`."""
    buffers = list(buffers)
    if not buffers:
        raise ValueError("clipping needs at least one gradient buffer")
    with _stream_context(buffers, stream):
        total = _total_norm(buffers, float(norm_type))
        xp = array_module(total)
        factor = xp.minimum(xp.asarray(max_norm / (total + eps), dtype=xp.float32),
                            xp.float32(1.0))
    return total, factor


def clip_by_global_norm(buffers, max_norm: float, norm_type: float = 2.0, eps: float = 1e-6,
                        *, stream=None):
    """Scale flat gradient buffers in place so their joint norm is at most ``max_norm``,
    with :func:`clip_coefficient`'s factor computed on the device (no host sync): one
    reduction per buffer and one in-place scale. Returns the norm before clipping (0-d)."""
    buffers = list(buffers)
    total, factor = global_norm_clip_factor(buffers, max_norm, norm_type, eps, stream=stream)
    with _stream_context(buffers, stream):
        for g in buffers:
            xp = array_module(g)
            coef = xp.asarray(factor)
            if g.dtype == np.float32:
                g *= coef
            else:  # 16-bit gradients: scale in float32, round once
                g[...] = (g.astype(xp.float32) * coef).astype(g.dtype)
    return total


def clip_coefficient(total_norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: ``min(1, max_norm / (total_norm + eps))``."""
    return min(1.0, max_norm / (total_norm + eps))
