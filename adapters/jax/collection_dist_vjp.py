"""The owners' side of a :class:`~xferlib.adapters.jax.collection_dist.ShardedCollection`
step: the ``custom_vjp`` whose forward and backward are ``buffer_callback``s, each device's
running the collection of its rank (the pooled lookup of what it received; the fused backward
+ update on the rows it holds), on XLA's stream there.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from xferlib.adapters.jax._callback import (as_core_array, buffer_device, device_scope,
                                            is_gpu_buffer, recordable_scope,
                                            recording_pools, vary_like, xla_stream)
from xferlib.adapters.jax.errors import reporting
from xferlib.adapters.jax.host import fill_token
from xferlib.backend import as_cupy_stream, stream_scope
from xferlib.collection.numpy_path import check_inputs_numpy

__all__ = ["OFFSETS_RULE", "on_device", "sharded_function"]

OFFSETS_RULE = ("offsets must start at 0, never decrease, and end at most at the padded "
                 "length of the indices")



def on_device(ordinal):
    """CuPy's current device for a rank's collection (a no-op on the CPU backend)."""
    if ordinal is None:
        import contextlib

        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(ordinal)


def sharded_function(sharded):
    """The owners' pooled lookup as a custom_vjp: each device's callback runs the collection
    of its rank (the rank arrives as an input buffer, read on the host)."""
    shards, ordinals = sharded.shards, sharded._ordinals
    max_dim = sharded.max_dim
    # record: the owners' callbacks marked command_buffer_compatible, so XLA records their
    # kernels into its command buffers and replays them (ShardedCollection's ``record``).
    recorded = sharded.record
    # device -> the callbacks' private CuPy pool (see recordable_scope)
    pools = recording_pools(sharded) if recorded else None

    def scope(ctx, gpu):
        return recordable_scope(pools, ctx, gpu) if recorded else contextlib.nullcontext(False)

    def host_ints(buffer, gpu, stream, start, stop):
        """``buffer[start:stop]`` as host ints; on a GPU once the work XLA queued before on
        ``stream`` is done (a copy on that stream, waited for)."""
        array = as_core_array(buffer, gpu)[start:stop]
        if gpu:
            array = array.get(stream=as_cupy_stream(stream))
        return [int(v) for v in array]

    def rank_of(rank_b, gpu, stream) -> int:
        """This device's rank: on a GPU, from the device its buffers live on (no wait)."""
        if gpu:
            return ordinals.index(buffer_device(rank_b))
        return host_ints(rank_b, gpu, stream, 0, 1)[0]

    def core_inputs(rank_b, idx_b, off_b, w_b, B, gpu, stream):
        """This device's collection and its batch: the received lookups cut to their true
        count (read from the offsets), views of XLA's buffers."""
        rank, n_bad, n_long, n_off = host_ints(rank_b, gpu, stream, 0, 4)
        coll = shards[rank]
        if n_off:  # nothing travelled: every device raises alike
            raise ValueError(f"malformed offsets on {n_off} device(s) of the mesh "
                             f"({OFFSETS_RULE}); no table changed")
        if n_long:  # nothing travelled: every device raises alike
            raise ValueError(f"{n_long} bag(s) longer than max_bag_size="
                             f"{sharded.max_bag_size} on the mesh; no table changed")
        if n_bad:  # this device's own error first, else the other device's
            if coll is not None:
                off = np.array(host_ints(off_b, gpu, stream, 0, coll.num_tables * B + 1))
                idx = np.array(host_ints(idx_b, gpu, stream, 0, int(off[-1])))
                check_inputs_numpy(coll, idx, off)
            raise IndexError(f"{n_bad} index(es) out of range on another device of the "
                             f"mesh (an out-of-range lookup is sent to its table's owner); "
                             f"no table changed")
        if coll is None:
            return rank, None, None, None, None
        T_me = coll.num_tables
        n, = host_ints(off_b, gpu, stream, T_me * B, T_me * B + 1)
        off = as_core_array(off_b, gpu)[:T_me * B + 1]
        idx = as_core_array(idx_b, gpu)[:n]
        w = unweighted_or(as_core_array(w_b, gpu)[:n])
        if not gpu:  # the NumPy path takes its own copies
            off, idx = np.array(off), np.array(idx)
            w = None if w is None else np.array(w)
        return rank, coll, idx, off, w

    def unweighted_or(w):
        """The received weights; None for the empty buffer of an unweighted step (no
        weights travel: the owner pools by plain sums)."""
        return w if w.size else None

    def key(rank, *buffers):
        """A batch's key between its forward and backward callbacks: its rank and where its
        input buffers lie, with their shapes (a residual keeps them alive). Not the output:
        the update receives it through ``vary_like``, which may be a copy."""
        def address(buffer):
            try:
                ptr = buffer.__cuda_array_interface__["data"][0]
            except Exception:  # CPU buffers have no CUDA interface
                ptr = np.asarray(buffer).ctypes.data
            return ptr, tuple(getattr(buffer, "shape", ()))
        return (rank, *map(address, buffers))

    def gpu_inputs(rank_b, idx_b, off_b, w_b, B):
        """On a GPU, nothing read back: the received buffers whole, a padded batch (its
        true size is in the offsets, on the device). A bad lookup comes to its owner alone
        (see ``_step``): that owner's collection refuses the batch and keeps the error for
        :meth:`ShardedCollection.check` (``raise_in_calls`` is off)."""
        rank = rank_of(rank_b, True, None)
        coll = shards[rank]
        if coll is None:
            return rank, None, None, None, None
        off = as_core_array(off_b, True)[:coll.num_tables * B + 1]
        return rank, coll, as_core_array(idx_b, True), off, unweighted_or(
            as_core_array(w_b, True))

    def forward_callback(train):
        @reporting
        def callback(ctx, out, rank_b, idx_b, off_b, w_b):
            gpu = is_gpu_buffer(out)
            with device_scope(gpu, out), scope(ctx, gpu) as recording:
                stream = xla_stream(ctx, gpu)
                out = as_core_array(out, gpu)
                rank, coll, idx, off, w = (
                    gpu_inputs(rank_b, idx_b, off_b, w_b, out.shape[0]) if gpu else
                    core_inputs(rank_b, idx_b, off_b, w_b, out.shape[0], gpu, stream))
                with stream_scope(stream, gpu):
                    out.fill(0)
                    if gpu:  # refused batches counted, for check()
                        sharded._refused[rank] += as_core_array(rank_b, gpu)[2:4] != 0
                if coll is None:
                    return
                pooled, lookup = coll.forward(idx, off, w, stream=stream, padded=gpu,
                                              _for_update=train)
                with stream_scope(stream, gpu):
                    out[:, :coll.total_dim] = pooled
                if train:
                    coll.keep_context(key(rank, idx_b, off_b, w_b), lookup, recording)
        return callback

    @reporting
    def update_callback(ctx, token, rank_b, idx_b, off_b, w_b, out_b, g_b):
        gpu = is_gpu_buffer(token)
        with device_scope(gpu, token), scope(ctx, gpu) as recording:
            stream = xla_stream(ctx, gpu)
            fill_token(ctx, token, gpu)
            g = as_core_array(g_b, gpu)
            rank = rank_of(rank_b, gpu, stream)
            coll = shards[rank]
            if coll is None:
                return
            # the forward's plan: no host read
            lookup = coll.take_context(key(rank, idx_b, off_b, w_b), recording)
            if lookup is None:  # the forward's context is gone: plan the batch again
                _, coll, idx, off, w = (
                    gpu_inputs(rank_b, idx_b, off_b, w_b, g.shape[0]) if gpu else
                    core_inputs(rank_b, idx_b, off_b, w_b, g.shape[0], gpu, stream))
                _, lookup = coll.forward(idx, off, w, stream=stream, padded=gpu)
            with stream_scope(stream, gpu):
                grad = g[:, :coll.total_dim]
                grad = grad if grad.flags.c_contiguous else grad.copy()
            coll.backward(lookup, grad, stream=stream)

    def pooled(rank, idx, off, w, B, callback):
        out_type = jax.ShapeDtypeStruct((B, max_dim), sharded.dtype)
        out = buffer_callback(callback, out_type, has_side_effect=True,
                              command_buffer_compatible=recorded)(rank, idx, off, w)
        # Typed as differing between devices (it does): JAX types a callback's output as
        # the same on every device, and would sum its gradient over the mesh.
        return vary_like(out, idx)

    lookup_cb, train_cb = forward_callback(False), forward_callback(True)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
    def function(anchor, rank, idx, off, w, B):
        return pooled(rank, idx, off, w, B, lookup_cb)

    def fwd(anchor, rank, idx, off, w, B):
        out = pooled(rank, idx, off, w, B, train_cb)
        return out, (anchor, rank, idx, off, w, out)

    def bwd(B, res, g):
        anchor, rank, idx, off, w, out = res
        token_type = jax.ShapeDtypeStruct((), np.int32)
        # The forward's output is an input of the update, unread: the update runs after the
        # lookup. Nothing reads the token: the side effect keeps the update.
        buffer_callback(update_callback, token_type, has_side_effect=True,
                        command_buffer_compatible=recorded)(
            rank, idx, off, w, out, g.astype(sharded.dtype))
        f0 = jax.dtypes.float0
        return (jnp.zeros_like(anchor), np.zeros(rank.shape, f0), np.zeros(idx.shape, f0),
                np.zeros(off.shape, f0), jnp.zeros_like(w))

    function.defvjp(fwd, bwd)
    return function
