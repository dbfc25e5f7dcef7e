"""``tt_embedding_bag`` for JAX: a ``custom_vjp`` over ``buffer_callback``.

Cores use FBTT's layout without its leading table axis: core ``k`` is
``(p_k, R_k * q_k * R_{k+1})``; ``ranks`` are the inner ranks, as ``tt_ranks`` is given to
``TTEmbeddingBag``. Gradients flow to the cores, so any optax optimizer trains them. On the
CPU backend xferlib's NumPy path runs on XLA's buffers; on a GPU backend the same code runs
on CuPy views of them, on XLA's stream. ``tt_lookup`` / ``tt_update`` (``tt_table.py``,
re-exported here) train a stateful :class:`xferlib.tt.TTTable` with its fused update instead.

Bad indices and offsets raise before anything is computed: an eager call (concrete
``indices`` and ``offsets``) raises the core's IndexError / ValueError before the op runs;
under ``jit`` XLA's runtime error is raised again by type inside
:func:`~xferlib.adapters.jax.typed_errors` (see ``errors.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from xferlib import tt as core
from xferlib.adapters.jax._callback import (as_core_array, callback_scope, is_gpu_buffer,
                                            vary_like, varying_axes)
from xferlib.adapters.jax.errors import as_index_array, is_concrete, reporting, typed_errors
from xferlib.adapters.jax.tt_table import tt_lookup, tt_update

__all__ = ["tt_embedding_bag", "tt_lookup", "tt_update"]


def _arrays(ctx, buffers, outs=()):
    """Core arrays for XLA's buffers and the device and stream context to run them in."""
    gpu = any(is_gpu_buffer(b) for b in buffers)
    return ([as_core_array(b, gpu) for b in buffers],
            callback_scope(ctx, gpu, *outs, *buffers), gpu)


@functools.lru_cache(maxsize=None)
def _make(shape: core.TTShape, mode: str, include_last_offset: bool, weighted: bool,
          sum_axes: tuple = ()):
    """``sum_axes``: mesh axes the batch is sharded over and the cores are not: the core
    gradients are summed over them (the gradient of the global batch)."""
    d = shape.d

    def split(arrays):
        cores, rest = arrays[:d], arrays[d:]
        weights = rest[2] if weighted else None
        return cores, rest[0], rest[1], weights

    @reporting
    def forward_callback(ctx, out, *args):
        arrays, stream, gpu = _arrays(ctx, args, (out,))
        with stream:
            cores, indices, offsets, weights = split(arrays)
            as_core_array(out, gpu)[...] = core.tt_embedding_bag(
                cores, shape, indices, offsets, mode=mode, per_sample_weights=weights,
                include_last_offset=include_last_offset)

    @reporting
    def backward_callback(ctx, outs, *args):
        arrays, stream, gpu = _arrays(ctx, args, outs)
        with stream:
            grad_bags = arrays[-1]
            cores, indices, offsets, weights = split(arrays[:-1])
            residuals = core.tt_bag_residuals(
                shape, indices, offsets, mode=mode, per_sample_weights=weights,
                include_last_offset=include_last_offset)
            if not isinstance(residuals, core.TTBagPlan):  # (indices, bag, weights, bags)
                residuals = residuals[:3]
            grads = core.tt_embedding_bag_bwd(cores, shape, residuals, grad_bags)
            for out, grad in zip(outs, grads):
                as_core_array(out, gpu)[...] = grad

    def num_bags(offsets):
        return offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]

    def bags(cores, indices, offsets, weights):
        out_type = jax.ShapeDtypeStruct((num_bags(offsets), shape.dim), jnp.float32)
        extra = (weights,) if weighted else ()
        out = buffer_callback(forward_callback, out_type)(*cores, indices, offsets, *extra)
        # Under shard_map the bags are this device's (they come from its shard of the batch).
        return vary_like(out, indices, offsets) if varying_axes(indices, offsets) else out

    @jax.custom_vjp
    def function(cores, indices, offsets, weights):
        return bags(cores, indices, offsets, weights)

    def fwd(cores, indices, offsets, weights):
        return bags(cores, indices, offsets, weights), (cores, indices, offsets, weights)

    def bwd(residuals, g):
        cores, indices, offsets, weights = residuals
        out_types = tuple(jax.ShapeDtypeStruct(c.shape, jnp.float32) for c in cores)
        extra = (weights,) if weighted else ()
        grads = buffer_callback(backward_callback, out_types)(*cores, indices, offsets, *extra,
                                                              g.astype(jnp.float32))
        if sum_axes:  # one all-reduce of this device's core gradients: the global batch's
            grads = jax.lax.psum(tuple(vary_like(x, indices, offsets) for x in grads),
                                 sum_axes)
        zero_int = np.zeros(indices.shape, jax.dtypes.float0)
        zero_off = np.zeros(offsets.shape, jax.dtypes.float0)
        return tuple(grads), zero_int, zero_off, None if weights is None else weights * 0

    function.defvjp(fwd, bwd)
    return function


def tt_embedding_bag(cores, indices, offsets, *, p_shapes, q_shapes, ranks, mode="sum",
                     include_last_offset=True, per_sample_weights=None, axis_name=None):
    """Pooled rows of a TT table: ``(B, prod(q_shapes))`` float32, differentiable w.r.t. the
    cores (not w.r.t. ``per_sample_weights``).

    On a device mesh (inside ``jax.shard_map``, the bags sharded, the cores replicated) the
    core gradient is the global batch's: this device's gradient summed over the mesh axes the
    batch is sharded on, in the backward pass (one ``psum``). With ``check_vma=True`` (the
    default) those axes are read from the arguments' types; with ``check_vma=False`` name
    them: ``axis_name="batch"`` (a name or a tuple). See docs/jax-mesh.md.

    ``p_shapes``, ``q_shapes``, ``ranks`` are a :class:`xferlib.tt.TTShape`'s fields: cores
    for them come from ``xferlib.tt.init_tt_cores(TTShape(p_shapes, q_shapes, ranks))``.

    Bad input raises before anything is computed, the cores untouched. An index out of range
    (a message starting "index 700 at position 2 is out of range for a TT table of 600 rows")
    or offsets that do not start at 0, decrease, or end at ``len(indices)``: IndexError /
    ValueError in an eager call (concrete ``indices`` and ``offsets``, checked on the host
    before the op runs); under ``jit`` XLA's runtime error, which
    :func:`~xferlib.adapters.jax.typed_errors` raises as
    :class:`~xferlib.adapters.jax.CallbackIndexError` / ``CallbackValueError``."""
    shape = core.TTShape(p_shapes, q_shapes, ranks)
    cores = tuple(jnp.asarray(c, jnp.float32) for c in cores)
    shape.check_cores([np.empty(c.shape, np.uint8) for c in cores])
    if mode not in ("sum", "mean"):
        raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
    indices = as_index_array("indices", indices)
    offsets = as_index_array("offsets", offsets, ValueError)
    if not jnp.issubdtype(indices.dtype, jnp.integer) or not jnp.issubdtype(offsets.dtype,
                                                                           jnp.integer):
        raise TypeError("indices and offsets must be integer arrays")
    if indices.ndim != 1 or offsets.ndim != 1:
        raise ValueError(f"indices and offsets must be 1-D, got shapes {indices.shape} and "
                         f"{offsets.shape}")
    if offsets.shape[0] == 0:  # a shape: known under jit too
        raise ValueError("offsets must be a non-empty 1-D array")
    weights = None if per_sample_weights is None else jnp.asarray(per_sample_weights,
                                                                  jnp.float32)
    if weights is not None and weights.shape != indices.shape:
        raise ValueError(f"per_sample_weights must have shape {indices.shape} (one per index), "
                         f"got {weights.shape}")
    if is_concrete(indices, offsets):
        # An eager call: the core's own checks (index range, offsets) on the host now, so a
        # bad batch raises its IndexError / ValueError before the op runs.
        core.tt_bag_residuals(shape, np.asarray(indices), np.asarray(offsets),
                              include_last_offset=bool(include_last_offset))
    named = () if axis_name is None else (
        tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,))
    sharded = varying_axes(indices, offsets, weights) - varying_axes(*cores)
    sum_axes = tuple(sorted(set(named) | sharded, key=str))
    with typed_errors():  # an eager call runs here; under jit this only traces
        return _make(shape, mode, bool(include_last_offset), weights is not None, sum_axes)(
            cores, indices, offsets, weights)
