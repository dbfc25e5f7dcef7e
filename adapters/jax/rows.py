"""Differentiable row gather for JAX, usable under jit, grad, scan and vmap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from xferlib import rows as core_rows
from xferlib.adapters.jax._callback import (as_core_array, device_scope, is_gpu_buffer,
                                            vary_like, varying_axes, xla_stream)
from xferlib.adapters.jax.errors import as_index_array, is_concrete, reporting, typed_errors


@reporting
def _gather_callback(ctx, out, table, idx):
    gpu = is_gpu_buffer(out)
    with device_scope(gpu, out, idx):
        core_rows.gather_rows_fwd(as_core_array(table, gpu), as_core_array(idx, gpu),
                                  out=as_core_array(out, gpu), stream=xla_stream(ctx, gpu))
        core_rows.check_rows()  # a bad index fails this XLA call, not a later one


@reporting
def _scatter_add_callback(ctx, out, idx, grad_rows):
    gpu = is_gpu_buffer(out)
    num_rows = out.shape[0]
    with device_scope(gpu, out, idx):
        core_rows.gather_rows_bwd((as_core_array(idx, gpu), num_rows),
                                  as_core_array(grad_rows, gpu), out=as_core_array(out, gpu),
                                  stream=xla_stream(ctx, gpu))
        core_rows.check_rows()


# vmap: "sequential" runs the op once per batch element (a correct loop, not a fused batch).
def _gather(table, idx):
    out_type = jax.ShapeDtypeStruct((idx.shape[0], table.shape[1]), table.dtype)
    out = buffer_callback(_gather_callback, out_type, vmap_method="sequential")(table, idx)
    # Under shard_map with sharded indices the rows are this device's (see _callback.py).
    return vary_like(out, table, idx) if varying_axes(table, idx) else out


def _table_grad(idx, grad_rows, num_rows):
    out_type = jax.ShapeDtypeStruct((num_rows, grad_rows.shape[1]), grad_rows.dtype)
    return buffer_callback(_scatter_add_callback, out_type,
                           vmap_method="sequential")(idx, grad_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_rows(sum_axes, table, idx):
    return _gather(table, idx)


def _gather_rows_fwd(sum_axes, table, idx):
    return _gather(table, idx), (idx, table.shape[0])


def _gather_rows_bwd(sum_axes, residuals, g):
    idx, num_rows = residuals
    idx_cotangent = np.zeros(idx.shape, dtype=jax.dtypes.float0)
    grad = _table_grad(idx, g, num_rows)
    if sum_axes:  # a replicated table read by sharded indices: the global batch's gradient
        grad = jax.lax.psum(vary_like(grad, idx), sum_axes)
    return grad, idx_cotangent


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def gather_rows(table: jax.Array, idx: jax.Array) -> jax.Array:
    """``table[idx]`` as a differentiable op over xferlib's sorted, deduplicated gather.

    ``table``: 2-D float array; ``idx``: 1-D int32/int64 indices. The gradient w.r.t.
    ``table`` is a dense scatter-add of the incoming rows (repeated indices summed
    deterministically). An out-of-range index raises instead of being clamped as
    ``table[idx]`` would be: IndexError in an eager call (a concrete ``idx``, checked before
    the op runs); under ``jit`` XLA's runtime error, raised as
    :class:`~xferlib.adapters.jax.CallbackIndexError` (an IndexError) inside
    :func:`~xferlib.adapters.jax.typed_errors`. The message starts with the bad index and
    its position.

    >>> import jax, jax.numpy as jnp
    >>> from xferlib.adapters.jax import gather_rows
    >>> table = jnp.ones((10, 4))
    >>> jax.grad(lambda t: gather_rows(t, jnp.array([1, 1, 3])).sum())(table)[1].tolist()
    [2.0, 2.0, 2.0, 2.0]
    """
    table = jnp.asarray(table)
    idx = as_index_array("idx", idx)
    if table.ndim != 2:
        raise ValueError(f"table must be 2-D, got shape {table.shape}")
    if idx.ndim != 1:
        raise ValueError(f"idx must be 1-D, got shape {idx.shape}")
    if idx.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"idx must be int32 or int64, got {idx.dtype}")
    if is_concrete(idx):  # an eager call: the core's range check now, before the op runs
        core_rows.check_host_indices(np.asarray(idx), table.shape[0])
    with typed_errors():  # an eager call runs here; under jit this only traces
        return _gather_rows(tuple(sorted(varying_axes(idx) - varying_axes(table), key=str)),
                            table, idx)
