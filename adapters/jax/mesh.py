"""Host tables on a JAX device mesh: one table in host RAM, every device of the host training it.

Inside ``jax.shard_map`` over a 1-D mesh of the host's devices the batch is sharded and the
table is shared (xferlib owns it; every device reaches its pinned memory):

* lookups: :func:`~xferlib.adapters.jax.host_lookup` as on one device; each device gathers its
  own shard's rows on its own stream;
* updates: :func:`sharded_host_update` all-gathers the devices' indices and gradients (the
  global batch, in device order, exactly as one device would see it), and each device applies
  the table's optimizer to the rows it owns (``row % n_devices == axis_index``), the
  duplicates of a row summed in the global batch's order. Every row is updated once per step,
  by one device, as one device training on the global batch would update it;
* ordering: the devices' update tokens are summed (``psum``), so no device passes the update
  before every device has applied its share; a later lookup that depends on the token
  (``host_lookup(..., after=token)``, or anything run after the step on the same device) sees
  every update of the step.

TT tables need nothing new: replicate the cores, call ``tt_embedding_bag`` on the local bags
and sum the core gradients over the mesh (``jax.lax.psum``) before the optimizer step, as for
any replicated parameter. See docs/jax-mesh.md.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from xferlib.adapters.jax._callback import (as_core_array, device_scope, is_gpu_buffer,
                                            vary_like, xla_stream)
from xferlib.adapters.jax._views import on_device
from xferlib.adapters.jax.errors import reporting
from xferlib.adapters.jax.host import checked_update, fill_token, host_update, table_on
from xferlib.checks import index_error
from xferlib.table import HostTable

__all__ = ["sharded_host_update", "mesh_barrier"]


def _axis_size(axis_name) -> int:
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as err:  # not inside shard_map / pmap over this axis
        raise ValueError(f"axis_name {axis_name!r} is not a mesh axis here: call "
                         f"sharded_host_update inside jax.shard_map over that axis") from err


def sharded_host_update(table: HostTable, idx: jax.Array, grad_rows: jax.Array, *,
                        axis_name) -> jax.Array:
    """:func:`~xferlib.adapters.jax.host_update` for a batch sharded over mesh axis
    ``axis_name``, called inside ``jax.shard_map`` with this device's ``idx`` and
    ``grad_rows``. Equals one device training on the global batch (the devices' shards
    concatenated in axis order): row ``r`` is updated by device ``r % n`` with the sum of
    every device's gradients for it.

    Returns a scalar int32 token, the same on every device, ready once EVERY device has
    applied its share: pass it to the next lookups (``host_lookup(..., after=token)``) or
    return it from the step. An out-of-range index raises IndexError on every device, before
    any device changes the table (under ``jit`` XLA's runtime error, raised as
    :class:`~xferlib.adapters.jax.CallbackIndexError` inside
    :func:`~xferlib.adapters.jax.typed_errors`; the message names the index and its position
    in the global batch first). The table must have no GPU cache (``cache_rows=0``): a cache
    lives on one device.

    >>> import numpy as np, jax, jax.numpy as jnp, xferlib
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from xferlib.adapters.jax import host_lookup, sharded_host_update
    >>> table = xferlib.HostTable(16, 4, optimizer="sgd", optimizer_kwargs={"lr": 1.0},
    ...                           init="zeros")
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    >>> def step(idx):
    ...     rows = host_lookup(table, idx)
    ...     return sharded_host_update(table, idx, jnp.ones_like(rows), axis_name="batch")
    >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("batch"), out_specs=P()))
    >>> int(f(jnp.array([3, 3, 5])))
    0
    >>> table.numpy()[[3, 5], 0].tolist()
    [-2.0, -1.0]
    """
    idx, grad_rows = checked_update(table, idx, grad_rows)
    n = _axis_size(axis_name)
    if table.cache_rows and n > 1:
        raise ValueError(f"table has cache_rows={table.cache_rows}: a GPU cache lives on one "
                         f"device and would go stale on a mesh of {n}; build the table with "
                         f"cache_rows=0")
    if n == 1:
        return host_update(table, idx, grad_rows)
    _prepare_views(table)
    # The global batch on every device, in axis order: each device picks the rows it owns.
    all_idx = jax.lax.all_gather(idx, axis_name, tiled=True)
    all_grads = jax.lax.all_gather(grad_rows, axis_name, tiled=True)
    owned = (all_idx % n) == jax.lax.axis_index(axis_name).astype(all_idx.dtype)

    @reporting
    def callback(ctx, token, idx_buffer, grad_buffer, owned_buffer):
        gpu = is_gpu_buffer(token)
        with device_scope(gpu, token, idx_buffer):
            _apply_owned(table_on(table, gpu, token, idx_buffer), as_core_array(idx_buffer, gpu),
                         as_core_array(grad_buffer, gpu), as_core_array(owned_buffer, gpu),
                         ctx, gpu)
            fill_token(ctx, token, gpu)

    token_type = jax.ShapeDtypeStruct((), np.int32)
    token = buffer_callback(callback, token_type, has_side_effect=True)(all_idx, all_grads,
                                                                         owned)
    # A real all-reduce (the token typed as per-device first; JAX would fold the psum of a
    # replicated value into a multiply): no device passes it before every device's update.
    return mesh_barrier(jax.lax.psum(vary_like(token, owned), axis_name))


def _prepare_views(table: HostTable) -> None:
    """Every local GPU's view of ``table`` with its GPU side made now, while tracing: inside
    the step's callbacks a device thread would allocate its pinned check ring, and a pinned
    allocation waits for every device, among them one whose collective waits for that
    thread (the step never finishes)."""
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    if not gpus:
        return
    import cupy

    for device in gpus:
        with cupy.cuda.Device(device.local_hardware_id):
            on_device(table, device.local_hardware_id).prepare_gpu()


def _apply_owned(table: HostTable, idx, grads, owned, ctx, gpu: bool) -> None:
    """Check the whole global batch, then apply this device's rows (in batch order)."""
    if not gpu:
        _raise_if_out_of_range(idx, table.num_rows)
        rows = np.flatnonzero(owned)
        if rows.size:
            table.apply_gradients(idx[rows], grads[rows])
        return
    import cupy

    from xferlib.backend import as_cupy_stream

    stream = as_cupy_stream(xla_stream(ctx, gpu))
    with stream:
        bad = (idx < 0) | (idx >= table.num_rows)
        # The step's one host read (it waits for XLA's stream): which rows this device owns
        # (a sized selection) and whether any device's index is bad (then no device writes).
        if idx.size and bool(bad.any()):
            _raise_if_out_of_range(cupy.asnumpy(idx, stream=stream), table.num_rows)
        rows = cupy.flatnonzero(owned)
        if rows.size:
            table.apply_gradients(idx[rows], cupy.ascontiguousarray(grads[rows]),
                                  stream=stream)


def _raise_if_out_of_range(idx, num_rows: int) -> None:
    bad = (idx < 0) | (idx >= num_rows)
    if idx.size and bad.any():
        position = int(np.argmax(bad))  # in the global batch
        raise index_error(position, int(idx[position]), num_rows)


def mesh_barrier(token: jax.Array) -> jax.Array:
    """``token`` passed through a side-effecting no-op, so the collective that made it (and
    the updates it waits for) runs even when the caller drops the token."""
    def callback(ctx, out, token_in):
        del ctx, out, token_in  # the output aliases the input: nothing to write

    return buffer_callback(callback, jax.ShapeDtypeStruct((), np.int32), has_side_effect=True,
                           input_output_aliases={0: 0})(token)
