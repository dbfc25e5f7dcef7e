"""Host-resident tables inside ``jax.jit``: look rows up and train them with the table's fused
sparse optimizer, on XLA's stream.

JAX never owns a host table (a ``pinned_host`` array is moved to the device before a callback
sees it), so the :class:`xferlib.HostTable` stays a Python object and these functions are
``buffer_callback`` ops that reach it: the GPU path launches xferlib's kernels on XLA's
compute stream, the CPU path runs the NumPy path on the host buffers. Both ops are marked as
having side effects, so XLA neither drops an update nor hoists, merges or caches a lookup;
within a step the update depends on the gradients, which depend on the lookup, and steps of a
``lax.scan`` or of successive jitted calls run in order, so a lookup always sees every
update queued before it.

    table = xferlib.HostTable(10_000_000, 64, optimizer="adam")

    @jax.jit
    def train_step(idx, labels):
        rows = host_lookup(table, idx)
        loss, g = jax.value_and_grad(loss_fn)(rows, labels)
        return loss, host_update(table, idx, g)

Bad indices raise before the table changes: an eager call (concrete ``idx``) raises the
core's IndexError before the op runs; under ``jit`` XLA reports the callback's IndexError as
a runtime error, which :func:`~xferlib.adapters.jax.typed_errors` raises again as
:class:`~xferlib.adapters.jax.CallbackIndexError` (an IndexError). See ``errors.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from xferlib.adapters.jax._callback import (as_core_array, buffer_device, device_scope,
                                            is_gpu_buffer, vary_like, varying_axes,
                                            xla_stream)
from xferlib.adapters.jax._views import on_device
from xferlib.adapters.jax.errors import as_index_array, is_concrete, reporting, typed_errors
from xferlib.rows import check_host_indices
from xferlib.table import HostTable

__all__ = ["host_lookup", "host_update"]


def fill_token(ctx, token, gpu: bool) -> None:
    """Write the scalar token's 0 (on XLA's stream on a GPU: one memset, no array made)."""
    if gpu:
        import cupy

        interface = token.__cuda_array_interface__
        cupy.cuda.runtime.memsetAsync(interface["data"][0], 0, np.dtype(token.dtype).itemsize,
                                      int(ctx.stream))
    else:
        as_core_array(token, gpu).fill(0)


def checked_indices(table, idx):
    """``idx`` as a 1-D int32/int64 JAX array; TypeError/ValueError for a bad table or idx,
    and IndexError for a concrete ``idx`` out of range."""
    if not isinstance(table, HostTable):
        raise TypeError(f"table must be an xferlib.HostTable, got {type(table).__name__}")
    idx = as_index_array("idx", idx)
    if idx.ndim != 1:
        raise ValueError(f"idx must be 1-D, got shape {idx.shape}")
    if idx.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"idx must be int32 or int64, got {idx.dtype}")
    if is_concrete(idx):
        # An eager call: the range check on the host now, a plain IndexError before the op
        # runs (under jit the values exist only inside the callback, which checks them there).
        check_host_indices(np.asarray(idx), table.num_rows)
    return idx


def table_on(table, gpu, *buffers):
    """The table as this callback's device sees it (see ``_views.py``)."""
    return on_device(table, buffer_device(*buffers)) if gpu else table


def host_lookup(table: HostTable, idx: jax.Array, *, after=None) -> jax.Array:
    """The rows ``idx`` of ``table``, ``(len(idx), dim)``, on the device JAX runs on.

    The rows are an ordinary JAX array: differentiate a loss with respect to them and hand
    the gradient to :func:`host_update`. Nothing is clamped: an index out of range raises,
    naming the index and its position first ("index 9 at position 1 is out of range for a
    table of 8 rows ..."):

    * eager (a concrete ``idx``): IndexError, before the op runs;
    * under ``jit``: XLA's runtime error; inside :func:`~xferlib.adapters.jax.typed_errors`
      it is raised as :class:`~xferlib.adapters.jax.CallbackIndexError`, an IndexError. On a
      GPU the check is read without a host sync: a bad batch's lookup writes nothing and its
      error comes from a later call or ``table.check()``.

    ``after``: optional JAX values (e.g. the token of an earlier :func:`host_update` or
    :func:`~xferlib.adapters.jax.sharded_host_update`) the lookup must wait for: a data
    dependency XLA and the runtime cannot reorder. Inside ``jax.shard_map`` each device looks
    up its own shard of the batch on its own stream (docs/jax-mesh.md).
    """
    idx = checked_indices(table, idx)
    deps = () if after is None else tuple(jax.tree_util.tree_leaves(after))

    @reporting
    def callback(ctx, out, idx_buffer, *_):
        gpu = is_gpu_buffer(out)
        with device_scope(gpu, out, idx_buffer):
            table_on(table, gpu, out, idx_buffer).lookup(
                as_core_array(idx_buffer, gpu), out=as_core_array(out, gpu),
                **({"stream": xla_stream(ctx, gpu)} if gpu else {}))

    out_type = jax.ShapeDtypeStruct((idx.shape[0], table.dim), np.dtype(table.dtype))
    with typed_errors():  # an eager call runs here; under jit this only traces
        rows = buffer_callback(callback, out_type, has_side_effect=True)(idx, *deps)
    # Inside shard_map the rows are this device's: typed so, a loss's gradient w.r.t. them
    # stays this device's (no implicit sum over the mesh).
    return vary_like(rows, idx) if varying_axes(idx) else rows


def checked_update(table: HostTable, idx, grad_rows):
    """``(idx, grad_rows)`` as the update callbacks take them, after the checks every update
    makes (index dtype and range, gradient shape, an optimizer to run)."""
    idx = checked_indices(table, idx)
    grad_rows = jnp.asarray(grad_rows, dtype=np.dtype(table.dtype))
    if grad_rows.shape != (idx.shape[0], table.dim):
        raise ValueError(f"grad_rows must have shape {(idx.shape[0], table.dim)}, "
                         f"got {grad_rows.shape}")
    if table.optimizer is None:
        raise ValueError("this table has no optimizer; build it with optimizer=...")
    return idx, grad_rows


def host_update(table: HostTable, idx: jax.Array, grad_rows: jax.Array) -> jax.Array:
    """Run ``table``'s optimizer on rows ``idx`` with ``grad_rows`` (repeated indices summed).

    Returns a scalar int32 token (0) that callers may ignore or thread into later work.

    Bad input raises before the table or its optimizer state changes. An index out of range:
    IndexError in an eager call (a concrete ``idx``, checked before the op runs); under
    ``jit`` XLA's runtime error, raised as :class:`~xferlib.adapters.jax.CallbackIndexError`
    (an IndexError) inside :func:`~xferlib.adapters.jax.typed_errors`. The message starts with
    the bad index and its position. On a GPU the check takes no host sync: a bad batch
    changes nothing and its error comes from a later call or ``table.check()``."""
    idx, grad_rows = checked_update(table, idx, grad_rows)

    @reporting
    def callback(ctx, token, idx_buffer, grad_buffer):
        gpu = is_gpu_buffer(token)
        with device_scope(gpu, token, idx_buffer):
            table_on(table, gpu, token, idx_buffer).apply_gradients(
                as_core_array(idx_buffer, gpu), as_core_array(grad_buffer, gpu),
                **({"stream": xla_stream(ctx, gpu)} if gpu else {}))
            fill_token(ctx, token, gpu)

    token_type = jax.ShapeDtypeStruct((), np.int32)
    with typed_errors():
        return buffer_callback(callback, token_type, has_side_effect=True)(idx, grad_rows)
