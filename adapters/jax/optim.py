"""Flat-buffer optimizers for JAX, as optax ``GradientTransformation``s.

``ravel(params)`` lays a parameter pytree out in one float32 array (each leaf on a 16-byte
boundary) and returns it with the function that undoes it. The transformations take and
return flat arrays::

    flat, unravel = ravel(params)
    tx = flat_adam(1e-3)
    state = tx.init(flat)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(flat, state, batch):
        grads = ravel_like(jax.grad(loss)(unravel(flat), batch), unravel)
        return flat_step(tx, grads, state, flat)      # or tx.update + optax.apply_updates

Where the work is done. Each update is elementwise over one array, and under ``jax.jit`` XLA
fuses it (with ``optax.apply_updates``, or the parameter write of :func:`flat_step`) into ONE
loop over the buffer that reads parameters, gradients and state once and writes them once:
the HBM floor, the speed of ``optax.adam`` on one raveled array. So the default
``impl="xla"`` expresses every rule in ``jax.numpy``. xferlib's flat CUDA kernel, run through
``buffer_callback`` (``impl="kernel"``), moves the same bytes but adds the callback's cost
(and copies where XLA cannot alias its buffers): measured slower under ``jit`` for every rule
here (docs/flat-optimizers.md), so it is kept only to compare against and for callers that
want the kernel's exact float32 operation order. Rules, names, defaults and the step count are
optax's; the state is ``FlatState(count, buffers)`` in both implementations, so a state moves
between them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from xferlib import optim as core
from xferlib.optim.rules import known_scalar
from xferlib.handoff import data_pointer
from xferlib.adapters.jax._callback import (as_core_array, device_scope, is_gpu_buffer,
                                            xla_stream)

__all__ = ["ravel", "ravel_like", "flat_sgd", "flat_adam", "flat_adamw", "flat_lion",
           "flat_step", "FlatState"]

IMPLS = ("xla", "kernel")


def _layout_for(shapes):
    return core.FlatLayout.from_shapes(shapes, dtype=np.float32)


def ravel(params):
    """``(flat, unravel)``: the pytree's leaves in one float32 array, 16-byte aligned."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    if not leaves:
        raise ValueError("ravel() needs a pytree with at least one array")
    leaves = [jnp.asarray(leaf) for leaf in leaves]  # Python numbers too
    layout = _layout_for([tuple(leaf.shape) for leaf in leaves])
    dtypes = [leaf.dtype for leaf in leaves]

    def unravel(flat):
        parts = [flat[s.offset:s.offset + s.size].reshape(s.shape).astype(dt)
                 for s, dt in zip(layout.segments, dtypes)]
        return jax.tree_util.tree_unflatten(treedef, parts)

    unravel.layout = layout
    unravel.treedef = treedef
    return _pack(layout, leaves), unravel


def ravel_like(tree, unravel):
    """Flatten ``tree`` (e.g. gradients) into the layout ``unravel`` came with: the same tree
    structure and leaf shapes as the parameters (ValueError otherwise)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef != unravel.treedef:
        raise ValueError(f"ravel_like: the tree's structure {treedef} is not the parameters' "
                         f"{unravel.treedef}")
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    for k, (leaf, seg) in enumerate(zip(leaves, unravel.layout.segments)):
        if tuple(leaf.shape) != tuple(seg.shape):
            raise ValueError(f"ravel_like: leaf {k} has shape {tuple(leaf.shape)}, the "
                             f"parameter's is {tuple(seg.shape)}")
    return _pack(unravel.layout, leaves)


def _pack(layout, leaves):
    pieces = []
    for i, (seg, leaf) in enumerate(zip(layout.segments, leaves)):
        pieces.append(jnp.ravel(leaf).astype(jnp.float32))
        end = layout.segments[i + 1].offset if i + 1 < len(layout.segments) else layout.total
        if end > seg.offset + seg.size:
            pieces.append(jnp.zeros(end - seg.offset - seg.size, jnp.float32))
    return jnp.concatenate(pieces)


class FlatState(NamedTuple):
    count: jax.Array  # int32 step count, optax's convention
    buffers: tuple  # the rule's state buffers, in the kernel's slot order


def _callback(name, layout, num_buffers, in_place=False):
    """The kernel call. Default: the gradients' buffer becomes the updates (optax's
    convention). ``in_place``: the parameters' buffer is updated instead (``flat_step``)."""
    def callback(ctx, outs, params, grads, *rest):
        *buffers_in, table = rest
        gpu = is_gpu_buffer(params)
        with device_scope(gpu, params, *outs):  # under shard_map: this device's GPU
            _run(ctx, outs, params, grads, buffers_in, table, gpu)

    def _run(ctx, outs, params, grads, buffers_in, table, gpu):
        stream = xla_stream(ctx, gpu)
        first, *buffers_out = [as_core_array(o, gpu) for o in outs]
        sources = [as_core_array(x, gpu) for x in (params if in_place else grads, *buffers_in)]
        for out, src in zip([first, *buffers_out], sources):  # when XLA could not alias
            if data_pointer(out) != data_pointer(src):
                _copy(out, src, gpu, stream)
        buffers = dict(zip(core.get_rule(name).slots, buffers_out))
        if in_place:
            core.apply_table(name, layout, first, as_core_array(grads, gpu), buffers,
                             as_core_array(table, gpu), stream=stream)
        else:
            core.apply_table(name, layout, as_core_array(params, gpu), first, buffers,
                             as_core_array(table, gpu), updates=first, stream=stream)

    return callback


def _copy(out, src, gpu, stream):
    if gpu:
        from xferlib.backend import as_cupy_stream

        with as_cupy_stream(stream):
            out[...] = src
    else:
        out[...] = src


def _transformation(name, used_slots, xla_rule, row_fn, hyper, impl, needs_params):
    """An optax GradientTransformation over flat float32 arrays. ``xla_rule(g, buffers, p,
    count_before, count) -> (updates, buffers)`` is the jax.numpy update; ``row_fn`` gives the
    kernel's scalar row for ``impl="kernel"``."""
    import optax

    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    rule_slots = core.get_rule(name).slots
    slots = [s for s in rule_slots if s in used_slots]
    if slots != list(rule_slots[:len(slots)]):
        raise AssertionError("state slots must be a prefix of the kernel's slot order")
    kernel = impl == "kernel"

    def init(params):
        _check_flat(params, "params", kernel)
        zeros = tuple(jnp.zeros_like(params) for _ in slots)
        return FlatState(jnp.zeros([], jnp.int32), zeros)

    def run(grads, state, params, in_place):
        _check_flat(grads, "grads", kernel)
        if params is None:
            if kernel or needs_params or in_place:
                raise ValueError(f"flat_{name} needs params"
                                 + (" (weight decay uses them)" if needs_params else ""))
        else:
            _check_flat(params, "params", kernel)
            if params.shape != grads.shape:
                raise ValueError(f"params {params.shape} and grads {grads.shape} differ")
        count = _safe_increment(state.count)
        if kernel:
            return _run_kernel(name, row_fn, hyper, grads, state, params, count, in_place)
        updates, buffers = xla_rule(grads, state.buffers, params, state.count, count)
        new_state = FlatState(count, tuple(buffers))
        if in_place:  # optax.apply_updates, fused by XLA into the same loop
            return (params + updates).astype(params.dtype), new_state
        return updates, new_state

    def update(updates, state, params=None):
        return run(updates, state, params, in_place=False)

    update.step_in_place = lambda grads, state, params: run(grads, state, params, True)
    update.impl = impl
    return optax.GradientTransformation(init, update)


def _run_kernel(name, row_fn, hyper, grads, state, params, count, in_place):
    """The flat CUDA kernel through buffer_callback: grads (or params) buffer -> output 0,
    state buffers updated in place (input/output aliasing), scalars computed in JAX."""
    row = row_fn(hyper, count, state.count)
    layout = _layout_for([tuple(params.shape)])
    table = row.reshape(1, -1)
    out_types = (jax.ShapeDtypeStruct(params.shape, jnp.float32),
                 *(jax.ShapeDtypeStruct(b.shape, jnp.float32) for b in state.buffers))
    # inputs: params 0, grads 1, buffers 2.., table last
    aliases = {0 if in_place else 1: 0, **{2 + i: 1 + i for i in range(len(state.buffers))}}
    outs = buffer_callback(_callback(name, layout, len(state.buffers), in_place), out_types,
                           input_output_aliases=aliases)(params, grads, *state.buffers, table)
    return outs[0], FlatState(count, tuple(outs[1:]))


def flat_step(tx, grads, state, params):
    """``(new_params, new_state)``: what ``tx.update`` followed by ``optax.apply_updates``
    gives, as one pass over the buffer. Donate ``params`` and ``state`` to the jitted step
    (``donate_argnums``) so XLA updates them in place: the step then reads parameters,
    gradients and state once and writes parameters and state once (28 bytes per parameter for
    Adam, against 36 for an update written out and read back). ``tx``: a transformation from
    ``flat_sgd``, ``flat_adam``, ``flat_adamw`` or ``flat_lion``.

    >>> import jax.numpy as jnp
    >>> from xferlib.adapters.jax import flat_adam, flat_step
    >>> tx = flat_adam(0.1)
    >>> params = jnp.ones(8)
    >>> params, state = flat_step(tx, jnp.ones(8), tx.init(params), params)
    >>> round(float(params[0]), 4)
    0.9
    """
    step = getattr(tx.update, "step_in_place", None)
    if step is None:
        raise TypeError("flat_step takes a transformation made by xferlib's flat_sgd, "
                        "flat_adam, flat_adamw or flat_lion")
    return step(grads, state, params)


def _check_flat(x, name, kernel):
    if not isinstance(x, jax.Array) or x.ndim != 1 or x.dtype != jnp.float32:
        raise TypeError(f"flat optimizers take one 1-D float32 array as {name}; lay a pytree "
                        f"out with xferlib.adapters.jax.ravel(params) (got {type(x).__name__} "
                        f"{getattr(x, 'shape', '')} {getattr(x, 'dtype', '')})")
    if kernel and x.shape[0] % 4:
        raise ValueError(f"the flat kernel takes a multiple of 4 floats (16-byte vectors); "
                         f"{name} has {x.shape[0]}: use ravel(), which pads each leaf")


def _safe_increment(count):
    """optax's step count: +1, saturating at the int32 maximum."""
    top = jnp.iinfo(jnp.int32).max
    return jnp.where(count < top, count + 1, top).astype(jnp.int32)


def _lr(learning_rate, count_before):
    return learning_rate(count_before) if callable(learning_rate) else learning_rate


def _scale_by_lr(updates, learning_rate, count_before):
    """optax.scale_by_learning_rate: a schedule is read at the count before this step."""
    return jnp.asarray(-_lr(learning_rate, count_before), dtype=updates.dtype) * updates


def _bias_correction(moment, decay, count):
    return moment / (1 - decay ** count).astype(moment.dtype)


def _row(common, scalars):
    values = [jnp.asarray(v, jnp.float32) for v in (*common, *scalars)]
    values += [jnp.float32(0.0)] * (core.COMMON + core.SCALARS - len(values))
    return jnp.stack(values)


def _rule_row(name, core_hyper, count):
    """The kernel's scalar row from the core rule's own scalars, computed in jax.numpy at
    ``count`` (traced: a schedule's learning rate and the step live on the device)."""
    rule = core.get_rule(name)
    return _row(core.common_scalars(rule, core_hyper), rule.scalars(core_hyper, count, {}, jnp))


def _check_impl_args(impl, **unsupported):
    """Options the kernel path does not have."""
    if impl == "kernel":
        for key, value in unsupported.items():
            if not isinstance(value, bool) and known_scalar(value) is None:
                raise ValueError(f"impl='kernel' takes {key} as a number (0), not a traced "
                                 f"value (optax.inject_hyperparams: list {key!r} in "
                                 "static_args)")
            if value:
                raise ValueError(f"impl='kernel' supports {key}=0/False only (got {value!r}); "
                                 "the default impl='xla' has it")


def flat_sgd(learning_rate, momentum=None, nesterov=False, *, impl="xla"):
    """``optax.sgd`` on a flat buffer.

    ``t <- g + momentum t``; update ``-lr t`` (nesterov: ``-lr (g + momentum t)``); without
    momentum the update is ``-lr g`` and the state holds no buffer. ``impl="xla"`` (default):
    jax.numpy, fused by XLA into one pass; ``impl="kernel"``: the flat CUDA kernel through
    ``buffer_callback`` (slower under jit; kept to compare).

    >>> import jax.numpy as jnp
    >>> tx = flat_sgd(0.5, momentum=0.9)
    >>> p = jnp.ones(4)
    >>> u, s = tx.update(jnp.ones(4), tx.init(p), p)
    >>> float(u[0])
    -0.5
    """
    mom = 0.0 if momentum is None else known_scalar(momentum)
    if mom is None:  # traced (optax's inject_hyperparams under jit): a buffer, as optax keeps
        if impl == "kernel":
            raise ValueError("flat_sgd(impl='kernel') takes momentum as a number, not a traced "
                             "value (optax.inject_hyperparams: list it in static_args)")
        mom = momentum

    def row(h, count, count_before):
        return _rule_row("sgd", dict(lr=_lr(learning_rate, count_before), momentum=mom,
                                     dampening=0.0, nesterov=nesterov), count)

    def xla_rule(g, buffers, p, count_before, count):
        if not buffers:  # the state says: no momentum (a traced momentum's init had 0.0)
            return _scale_by_lr(g, learning_rate, count_before), ()
        trace = g + mom * buffers[0]
        direction = g + mom * trace if nesterov else trace
        return _scale_by_lr(direction, learning_rate, count_before), (trace,)

    core.resolve_hyper("sgd", dict(lr=0.0 if callable(learning_rate) else learning_rate,
                                   momentum=mom, nesterov=nesterov))
    traced = known_scalar(mom) is None
    return _transformation("sgd", ["momentum_buffer"] if traced or mom else [], xla_rule, row,
                           {}, impl, needs_params=False)


def _adam_row(name, decoupled_wd):
    def row(h, count, count_before):
        lr = _lr(h["learning_rate"], count_before)
        return _rule_row(name, dict(lr=lr, betas=(h["b1"], h["b2"]), eps=h["eps"],
                                    weight_decay=decoupled_wd, amsgrad=False),
                         count.astype(jnp.float32))

    return row


def _moment(x, new, b):
    """optax's moment update (``update_moment``), written once for jax.numpy: ``(1 - b) new +
    b x``, in that order (the NumPy rules follow torch's order instead)."""
    return (1 - b) * new + b * x


def _adam_xla(h, weight_decay):
    """optax.scale_by_adam (+ add_decayed_weights) + scale_by_learning_rate, op for op."""
    b1, b2, eps, eps_root, nesterov = h["b1"], h["b2"], h["eps"], h["eps_root"], h["nesterov"]

    def rule(g, buffers, p, count_before, count):
        mu, nu = buffers
        mu = _moment(mu, g, b1)
        nu = _moment(nu, g ** 2, b2)
        if nesterov:  # Dozat 2016, as optax: the next step's bias correction on mu
            mu_hat = (b1 * _bias_correction(mu, b1, _safe_increment(count))
                      + (1 - b1) * _bias_correction(g, b1, count))
        else:
            mu_hat = _bias_correction(mu, b1, count)
        nu_hat = _bias_correction(nu, b2, count)
        direction = mu_hat / (jnp.sqrt(nu_hat + eps_root) + eps)
        if known_scalar(weight_decay) is None or weight_decay:  # traced: added, zero or not
            direction = direction + weight_decay * p
        return _scale_by_lr(direction, h["learning_rate"], count_before), (mu, nu)

    return rule


def flat_adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, *, nesterov=False,
              impl="xla"):
    """``optax.adam`` on a flat buffer.

    ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``, ``t <- t + 1``; update
    ``-lr m_hat / (sqrt(v_hat + eps_root) + eps)`` with ``m_hat = m / (1 - b1^t)``,
    ``v_hat = v / (1 - b2^t)``; ``nesterov`` as optax. ``impl="xla"`` (default): jax.numpy,
    which XLA fuses into one pass at the HBM floor; ``impl="kernel"``: the flat CUDA kernel
    through ``buffer_callback`` (slower under jit; ``eps_root`` and ``nesterov`` unsupported).

    >>> import jax.numpy as jnp
    >>> tx = flat_adam(0.1)
    >>> p = jnp.ones(4)
    >>> u, s = tx.update(jnp.full(4, 3.0), tx.init(p), p)
    >>> round(float(u[0]), 4)
    -0.1
    """
    _check_impl_args(impl, eps_root=eps_root, nesterov=nesterov)
    core.resolve_hyper("adam", dict(betas=(b1, b2), eps=eps))
    hyper = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                 nesterov=nesterov)
    return _transformation("adam", ["exp_avg", "exp_avg_sq"], _adam_xla(hyper, 0.0),
                           _adam_row("adam", 0.0), hyper, impl, needs_params=False)


def flat_adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=1e-4,
               *, nesterov=False, impl="xla"):
    """``optax.adamw`` on a flat buffer: Adam's direction plus ``weight_decay * p``, scaled by
    ``-lr`` (decoupled weight decay, as optax chains it). ``impl`` as :func:`flat_adam`; the
    kernel path also needs a constant learning rate.

    >>> import jax.numpy as jnp
    >>> tx = flat_adamw(0.1, weight_decay=0.5)
    >>> p = jnp.ones(4)
    >>> u, s = tx.update(jnp.zeros(4), tx.init(p), p)
    >>> round(float(u[0]), 4)
    -0.05
    """
    _check_impl_args(impl, eps_root=eps_root, nesterov=nesterov)
    if impl == "kernel" and callable(learning_rate):
        raise ValueError("flat_adamw(impl='kernel') takes a constant learning rate (the "
                         "kernel's decay factor uses it)")
    decay = known_scalar(weight_decay)  # None: traced (optax's inject_hyperparams)
    if callable(weight_decay) or (decay is not None and not decay >= 0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (a float >= 0)")
    if impl == "kernel" and decay is None:
        raise ValueError("flat_adamw(impl='kernel') takes weight_decay as a number, not a "
                         "traced value (optax.inject_hyperparams: list it in static_args)")
    core.resolve_hyper("adamw", dict(lr=0.0 if callable(learning_rate) else learning_rate,
                                     betas=(b1, b2), eps=eps, weight_decay=weight_decay))
    hyper = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                 nesterov=nesterov)
    return _transformation("adamw", ["exp_avg", "exp_avg_sq"], _adam_xla(hyper, weight_decay),
                           _adam_row("adamw", weight_decay), hyper, impl,
                           needs_params=decay is None or bool(decay))


def flat_lion(learning_rate, b1=0.9, b2=0.99, weight_decay=1e-3, *, impl="xla"):
    """``optax.lion`` on a flat buffer: update ``-lr (sign(b1 m + (1 - b1) g) + wd p)``, then
    ``m <- b2 m + (1 - b2) g``. ``impl`` as :func:`flat_adam`.

    >>> import jax.numpy as jnp
    >>> tx = flat_lion(0.1, weight_decay=0.0)
    >>> p = jnp.ones(4)
    >>> u, s = tx.update(-jnp.ones(4), tx.init(p), p)
    >>> round(float(u[0]), 4)
    0.1
    """
    core.resolve_hyper("lion", dict(learning_rate=0.0 if callable(learning_rate)
                                    else learning_rate, b1=b1, b2=b2, weight_decay=weight_decay))
    decay = known_scalar(weight_decay)  # None: traced (optax's inject_hyperparams)

    def row(h, count, count_before):
        return _rule_row("lion", dict(learning_rate=_lr(learning_rate, count_before), b1=b1,
                                      b2=b2, weight_decay=weight_decay), count)

    def xla_rule(g, buffers, p, count_before, count):
        (mu,) = buffers
        direction = jnp.sign(_moment(mu, g, b1))
        mu = _moment(mu, g, b2)
        if decay is None or decay:  # traced: added, zero or not
            direction = direction + weight_decay * p
        return _scale_by_lr(direction, learning_rate, count_before), (mu,)

    return _transformation("lion", ["exp_avg"], xla_rule, row, {}, impl,
                           needs_params=decay is None or bool(decay))
