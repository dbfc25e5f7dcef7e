"""Flat-buffer optimizers for JAX, as optax ``GradientTransformation``s.

``ravel(params)`` lays a parameter pytree out in one float32 array (each leaf on a 16-byte
boundary, as the kernels want) and returns it with the function that undoes it. The
transformations take and return flat arrays::

    flat, unravel = ravel(params)
    tx = flat_adam(1e-3)
    state = tx.init(flat)

    @jax.jit
    def train_step(flat, state, batch):
        grads = ravel_like(jax.grad(loss)(unravel(flat), batch), unravel)
        updates, state = tx.update(grads, state, flat)
        return optax.apply_updates(flat, updates), state

``update`` runs xferlib's flat kernel through ``buffer_callback``: the gradient buffer becomes
the updates and the moment buffers are updated in place (input/output aliasing), in one pass
over the buffer on XLA's stream. The per-step scalars (bias corrections) are computed in JAX
from the step count, so nothing waits on the host. Rules, names and defaults are optax's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from xferlib import optim as core
from xferlib._kernels.optim import slot_names
from xferlib.handoff import data_pointer
from xferlib.adapters.jax._callback import as_core_array, is_gpu_buffer, xla_stream

__all__ = ["ravel", "ravel_like", "flat_sgd", "flat_adam", "flat_adamw", "flat_lion",
           "flat_step", "FlatState"]


def _layout_for(shapes):
    return core.FlatLayout.from_shapes(shapes, dtype=np.float32)


def ravel(params):
    """``(flat, unravel)``: the pytree's leaves in one float32 array, 16-byte aligned."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    if not leaves:
        raise ValueError("ravel() needs a pytree with at least one array")
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
    """Flatten ``tree`` (e.g. gradients) into the layout ``unravel`` came with."""
    leaves = jax.tree_util.tree_leaves(tree)
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
        stream = xla_stream(ctx, gpu)
        first, *buffers_out = [as_core_array(o, gpu) for o in outs]
        sources = [as_core_array(x, gpu) for x in (params if in_place else grads, *buffers_in)]
        for out, src in zip([first, *buffers_out], sources):  # when XLA could not alias
            if data_pointer(out) != data_pointer(src):
                _copy(out, src, gpu, stream)
        kind = core._RULES[name].kind
        buffers = dict(zip(slot_names(kind), buffers_out))
        if in_place:
            core.apply_table(name, layout, first, as_core_array(grads, gpu), buffers,
                             as_core_array(table, gpu), stream=stream)
        else:
            core.apply_table(name, layout, as_core_array(params, gpu), first, buffers,
                             as_core_array(table, gpu), updates=first, stream=stream)

    return callback


def _copy(out, src, gpu, stream):
    if gpu:
        from xferlib._backend import as_cupy_stream

        with as_cupy_stream(stream):
            out[...] = src
    else:
        out[...] = src


def _transformation(name, used_slots, row_fn, hyper):
    """An optax GradientTransformation over flat float32 arrays running the flat kernel."""
    import optax

    kind = core._RULES[name].kind
    slots = [s for s in slot_names(kind) if s in used_slots]
    if slots != list(slot_names(kind)[:len(slots)]):
        raise AssertionError("state slots must be a prefix of the kernel's slot order")

    def init(params):
        _check_flat(params)
        zeros = tuple(jnp.zeros_like(params) for _ in slots)
        return FlatState(jnp.zeros([], jnp.int32), zeros)

    def run(grads, state, params, in_place):
        if params is None:
            raise ValueError(f"flat_{name} needs params (for weight decay and the kernel)")
        _check_flat(grads)
        _check_flat(params)
        count = state.count + 1
        row = row_fn(hyper, count, state.count)
        layout = _layout_for([tuple(params.shape)])
        table = row.reshape(1, -1)
        out_types = (jax.ShapeDtypeStruct(params.shape, jnp.float32),
                     *(jax.ShapeDtypeStruct(b.shape, jnp.float32) for b in state.buffers))
        # inputs: params 0, grads 1, buffers 2.., table last; grads (or params) -> output 0,
        # buffers in place
        aliases = {0 if in_place else 1: 0, **{2 + i: 1 + i for i in range(len(state.buffers))}}
        outs = buffer_callback(_callback(name, layout, len(slots), in_place), out_types,
                               input_output_aliases=aliases)(
            params, grads, *state.buffers, table)
        return outs[0], FlatState(count, tuple(outs[1:]))

    def update(updates, state, params=None):
        return run(updates, state, params, in_place=False)

    update.step_in_place = lambda grads, state, params: run(grads, state, params, True)
    return optax.GradientTransformation(init, update)


def flat_step(tx, grads, state, params):
    """``(new_params, new_state)``: what ``tx.update`` followed by ``optax.apply_updates``
    gives, in ONE pass of the flat kernel that updates the parameters' buffer in place
    (donate ``params`` and ``state`` to the jitted step so XLA aliases them). Saves the
    write and re-read of the updates that optax's convention costs (36 -> 28 bytes per
    parameter for Adam). ``tx``: a transformation from ``flat_sgd``, ``flat_adam``,
    ``flat_adamw`` or ``flat_lion``.

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


def _check_flat(x):
    if not isinstance(x, jax.Array) or x.ndim != 1 or x.dtype != jnp.float32:
        raise TypeError("flat optimizers take one 1-D float32 array; lay a pytree out with "
                        f"xferlib.adapters.jax.ravel(params) (got {type(x).__name__} "
                        f"{getattr(x, 'shape', '')} {getattr(x, 'dtype', '')})")
    if x.shape[0] % 4:
        raise ValueError(f"a flat buffer holds a multiple of 4 floats (16-byte vectors); got "
                         f"{x.shape[0]}: use ravel(), which pads each leaf")


def _lr(learning_rate, count_before):
    return learning_rate(count_before) if callable(learning_rate) else learning_rate


def _row(common, scalars):
    values = [jnp.asarray(v, jnp.float32) for v in (*common, *scalars)]
    values += [jnp.float32(0.0)] * (core.COMMON + core.SCALARS - len(values))
    return jnp.stack(values)


def flat_sgd(learning_rate, momentum=None, nesterov=False):
    """``optax.sgd`` on a flat buffer: ``t <- g + momentum t``; update ``-lr t`` (nesterov:
    ``-lr (g + momentum t)``)."""
    mom = 0.0 if momentum is None else float(momentum)

    def row(h, count, count_before):
        first = count == 1
        keep = jnp.where(first, 0.0, mom)
        return _row([1.0, 0.0, 1.0], [_lr(learning_rate, count_before), mom, keep, 1.0,
                                      float(mom != 0.0), float(nesterov)])

    core.resolve_hyper("sgd", dict(lr=0.0 if callable(learning_rate) else learning_rate,
                                   momentum=mom, nesterov=nesterov))
    return _transformation("sgd", ["momentum_buffer"] if mom else [], row, {})


def _adam_row(decoupled_wd):
    def row(h, count, count_before):
        lr = _lr(h["learning_rate"], count_before)
        b1, b2 = h["b1"], h["b2"]
        t = count.astype(jnp.float32)
        bc1 = 1.0 - jnp.power(jnp.float32(b1), t)
        bc2 = 1.0 - jnp.power(jnp.float32(b2), t)
        decay = 1.0 - lr * decoupled_wd if decoupled_wd else 1.0
        return _row([1.0, 0.0, decay], [lr / bc1, b1, b2, h["eps"], jnp.sqrt(bc2), 0.0])

    return row


def flat_adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0):
    """``optax.adam`` on a flat buffer (``eps_root`` must be 0)."""
    if eps_root:
        raise ValueError("flat_adam supports eps_root=0 only")
    core.resolve_hyper("adam", dict(betas=(b1, b2), eps=eps))
    hyper = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)
    return _transformation("adam", ["exp_avg", "exp_avg_sq"], _adam_row(0.0), hyper)


def flat_adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=1e-4):
    """``optax.adamw`` on a flat buffer: decoupled weight decay (``eps_root`` must be 0)."""
    if eps_root:
        raise ValueError("flat_adamw supports eps_root=0 only")
    if callable(learning_rate):
        raise ValueError("flat_adamw takes a constant learning rate (decay uses it)")
    core.resolve_hyper("adamw", dict(lr=learning_rate, betas=(b1, b2), eps=eps,
                                     weight_decay=weight_decay))
    hyper = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)
    return _transformation("adamw", ["exp_avg", "exp_avg_sq"], _adam_row(weight_decay), hyper)


def flat_lion(learning_rate, b1=0.9, b2=0.99, weight_decay=1e-3):
    """``optax.lion`` on a flat buffer."""
    core.resolve_hyper("lion", dict(learning_rate=0.0 if callable(learning_rate)
                                    else learning_rate, b1=b1, b2=b2, weight_decay=weight_decay))

    def row(h, count, count_before):
        return _row([1.0, 0.0, 1.0], [_lr(learning_rate, count_before), b1, b2, weight_decay])

    return _transformation("lion", ["exp_avg"], row, {})
