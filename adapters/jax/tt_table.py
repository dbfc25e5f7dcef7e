"""A :class:`xferlib.tt.TTTable` inside ``jax.jit``: pooled lookups and the fused TT update.

The table stays a Python object holding its cores, optimizer state, step counter and cache
(as a :class:`xferlib.HostTable` does for :mod:`xferlib.adapters.jax.host`); these two
functions are ``buffer_callback`` ops that reach it. :func:`tt_lookup` pools a batch's bags;
:func:`tt_update` runs backward and the optimizer in one on the cores in place (every core
row the batch touched, the step counter counted, an active cache's rows too): the fused
update :func:`xferlib.adapters.jax.tt_embedding_bag` leaves to an optax optimizer. Both are
marked as having side effects, so XLA neither drops an update nor hoists, merges or caches a
lookup; within a step the update depends on the gradient, which depends on the lookup, and
steps run in order. On the CPU the NumPy path runs on XLA's host buffers; on a GPU the
table's CuPy arrays are used on XLA's stream (one device: the table's).

    table = xferlib.TTTable(TTShape(p, q, ranks), "rowwise_adagrad", {"lr": 0.05})

    @jax.jit
    def train_step(indices, offsets, labels):
        bags = tt_lookup(table, indices, offsets)
        loss, g = jax.value_and_grad(loss_fn)(bags, labels)
        return loss, tt_update(table, indices, offsets, g)

Bad input raises before the table changes: an eager call on a NumPy table checks the batch
on the host first (IndexError / ValueError); under ``jit`` the callback's check raises
before anything is written, and :func:`~xferlib.adapters.jax.typed_errors` raises XLA's
error again by type (:class:`~xferlib.adapters.jax.CallbackIndexError`, ...).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from xferlib.adapters.jax._callback import (as_core_array, callback_scope, is_gpu_buffer,
                                            xla_stream)
from xferlib.adapters.jax.errors import as_index_array, is_concrete, reporting, typed_errors
from xferlib.adapters.jax.host import fill_token
from xferlib.tt.table import TTTable

__all__ = ["tt_lookup", "tt_update"]


def _batch(table, indices, offsets, per_sample_weights, mode, include_last_offset):
    """The batch as JAX arrays after the checks every op makes (the table, dtypes, shapes,
    and on a NumPy table with concrete arrays the whole core check, before the op runs)."""
    if not isinstance(table, TTTable):
        raise TypeError(f"table must be an xferlib.tt.TTTable, got {type(table).__name__}")
    if mode not in ("sum", "mean"):
        raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
    indices = as_index_array("indices", indices)
    offsets = as_index_array("offsets", offsets, ValueError)
    for name, a in (("indices", indices), ("offsets", offsets)):
        if a.dtype not in (jnp.int32, jnp.int64):
            raise TypeError(f"{name} must be int32 or int64, got {a.dtype}")
        if a.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    weights = None
    if per_sample_weights is not None:
        weights = jnp.asarray(per_sample_weights, jnp.float32)
        if weights.shape != indices.shape:
            raise ValueError(f"per_sample_weights must have shape {indices.shape} (one per "
                             f"index), got {weights.shape}")
    if not table.on_gpu and is_concrete(indices, offsets):
        # An eager call: the core's checks on the host now, before the op runs.
        table.residuals(np.asarray(indices), np.asarray(offsets), mode=mode,
                        include_last_offset=include_last_offset,
                        per_sample_weights=None if weights is None else np.asarray(weights))
    return indices, offsets, weights


def _num_bags(offsets, include_last_offset: bool) -> int:
    return max(offsets.shape[0] - (1 if include_last_offset else 0), 0)


def _split(buffers, gpu: bool, weighted: bool):
    arrays = [as_core_array(b, gpu) for b in buffers]
    return arrays[0], arrays[1], (arrays[2] if weighted else None), arrays[2 + weighted:]


def tt_lookup(table: TTTable, indices, offsets, *, per_sample_weights=None,
              mode: str = "sum", include_last_offset: bool = False, train: bool = True,
              after=None) -> jax.Array:
    """The pooled bags of ``table`` (:meth:`xferlib.tt.TTTable.lookup`): ``(B, dim)``
    float32 (``(T * B, dim)`` for ``T`` tables), an ordinary JAX array: differentiate a loss
    with respect to them and hand the gradient to :func:`tt_update` with the same batch.

    ``indices`` and ``offsets`` (int32 / int64; ``B + 1`` bounds with
    ``include_last_offset``, else ``B`` starts), ``per_sample_weights`` (one float per
    index) and ``mode`` as the table takes them. ``train``: count the lookups in the row
    cache's access frequencies (FBTT counts training lookups). ``after``: JAX values (e.g. a
    :func:`tt_update` token) the lookup must wait for. The batch is checked before the bags
    are written (IndexError for an index out of range, ValueError for bad offsets; under
    ``jit`` raised by type inside :func:`~xferlib.adapters.jax.typed_errors`)."""
    indices, offsets, weights = _batch(table, indices, offsets, per_sample_weights, mode,
                                       include_last_offset)
    weighted = weights is not None
    deps = () if after is None else tuple(jax.tree_util.tree_leaves(after))

    @reporting
    def callback(ctx, out, *buffers):
        gpu = is_gpu_buffer(out)
        with callback_scope(ctx, gpu, out, *buffers[:2]):  # the table's GPU ops on XLA's stream
            idx, off, w, _ = _split(buffers, gpu, weighted)
            # checked at once: a lookup's residuals do not reach the update callback
            table.lookup(idx, off, per_sample_weights=w, mode=mode,
                         include_last_offset=include_last_offset, train=False,
                         count_cache=train, stream=xla_stream(ctx, gpu),
                         out=as_core_array(out, gpu))

    out_type = jax.ShapeDtypeStruct((_num_bags(offsets, include_last_offset), table.dim),
                                    jnp.float32)
    extra = (weights,) if weighted else ()
    with typed_errors():  # an eager call runs here; under jit this only traces
        return buffer_callback(callback, out_type, has_side_effect=True)(
            indices, offsets, *extra, *deps)


def tt_update(table: TTTable, indices, offsets, grad_bags, *, per_sample_weights=None,
              mode: str = "sum", include_last_offset: bool = False, after=None) -> jax.Array:
    """The fused backward and optimizer step of ``table``
    (:meth:`xferlib.tt.TTTable.apply_gradients`) for the batch of a :func:`tt_lookup` (the
    same ``indices``, ``offsets``, weights and mode) and ``grad_bags``, the gradient of its
    bags. Every core row the batch touched takes one step of the table's optimizer; the
    table's step counter counts it.

    Returns a scalar int32 token (0) to ignore or thread into later work (``after=`` of a
    lookup). XLA orders the update after the lookup through the data: a ``grad_bags``
    computed from the bags (a loss's gradient) does it; a constant does not (a loss linear
    in the bags): pass ``after=bags`` then, the JAX values the update must wait for. Bad
    input raises before the cores, optimizer state or step counter change (on the GPU the
    kernels of a refused batch write none of them, as :meth:`xferlib.tt.TTTable` says)."""
    indices, offsets, weights = _batch(table, indices, offsets, per_sample_weights, mode,
                                       include_last_offset)
    grad_bags = jnp.asarray(grad_bags, jnp.float32)
    want = (_num_bags(offsets, include_last_offset), table.dim)
    if grad_bags.shape != want:
        raise ValueError(f"grad_bags must have shape {want}, got {grad_bags.shape}")
    weighted = weights is not None
    deps = () if after is None else tuple(jax.tree_util.tree_leaves(after))

    @reporting
    def callback(ctx, token, *buffers):
        gpu = is_gpu_buffer(token)
        with callback_scope(ctx, gpu, token, *buffers[:2]):
            idx, off, w, rest = _split(buffers, gpu, weighted)
            grad = rest[0]  # then the after= values, only waited for
            stream = xla_stream(ctx, gpu)
            residuals = table.residuals(idx, off, per_sample_weights=w, mode=mode,
                                        include_last_offset=include_last_offset,
                                        stream=stream)
            table.apply_gradients(residuals, grad, stream=stream)
            fill_token(ctx, token, gpu)

    extra = (weights,) if weighted else ()
    with typed_errors():
        return buffer_callback(callback, jax.ShapeDtypeStruct((), np.int32),
                               has_side_effect=True)(indices, offsets, *extra, grad_bags,
                                                     *deps)
