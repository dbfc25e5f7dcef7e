"""DLRM's dot interaction for JAX: :mod:`xferlib.interaction`'s two kernels as a
``jax.custom_vjp`` over ``buffer_callback``, usable inside ``jax.jit`` (and recorded into
XLA's command buffers with the rest of a step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from xferlib import interaction as core
from xferlib.adapters.jax._callback import (as_core_array, device_scope, is_gpu_buffer,
                                            recordable_scope, vary_like, varying_axes,
                                            xla_stream)
from xferlib.adapters.jax.errors import reporting

_KERNEL_DTYPES = (jnp.float32, jnp.float64)


# The op allocates nothing (its outputs are XLA's buffers): this private pool of
# recordable_scope's stays empty; the scope gives a recorded call CUDA's relaxed capture mode
# (a first call may load the kernels' module).
_POOLS: dict = {}


@reporting
def _forward_callback(ctx, out, x, pooled):
    gpu = is_gpu_buffer(out)
    with device_scope(gpu, out, x), recordable_scope(_POOLS, ctx, gpu):
        core.dot_interaction_fwd(as_core_array(x, gpu), as_core_array(pooled, gpu),
                                 out=as_core_array(out, gpu), stream=xla_stream(ctx, gpu))


@reporting
def _backward_callback(ctx, outs, x, pooled, g):
    dx, dpooled = outs
    gpu = is_gpu_buffer(dx)
    with device_scope(gpu, dx, x), recordable_scope(_POOLS, ctx, gpu):
        core.dot_interaction_bwd((as_core_array(x, gpu), as_core_array(pooled, gpu)),
                                 as_core_array(g, gpu), dx=as_core_array(dx, gpu),
                                 dpooled=as_core_array(dpooled, gpu),
                                 stream=xla_stream(ctx, gpu))


def _forward(x, pooled):
    B, T, d = pooled.shape
    out_type = jax.ShapeDtypeStruct((B, core.interaction_width(T, d)), x.dtype)
    out = buffer_callback(_forward_callback, out_type, vmap_method="sequential",
                          command_buffer_compatible=True)(x, pooled)
    # Under shard_map with a sharded batch the output is this device's (see _callback.py).
    return vary_like(out, x, pooled) if varying_axes(x, pooled) else out


@jax.custom_vjp
def _dot_interaction(x, pooled):
    return _forward(x, pooled)


def _dot_interaction_fwd(x, pooled):
    return _forward(x, pooled), (x, pooled)


def _dot_interaction_bwd(residuals, g):
    x, pooled = residuals
    out_types = (jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct(pooled.shape, pooled.dtype))
    dx, dpooled = buffer_callback(_backward_callback, out_types, vmap_method="sequential",
                                  command_buffer_compatible=True)(x, pooled, g.astype(x.dtype))
    if varying_axes(x, pooled, g):
        dx, dpooled = vary_like(dx, x, pooled, g), vary_like(dpooled, x, pooled, g)
    return dx, dpooled


_dot_interaction.defvjp(_dot_interaction_fwd, _dot_interaction_bwd)


def _plain(x, pooled):
    """The interaction in ``jnp`` ops (an einsum and the upper triangle): the same values,
    for dtypes and shapes the kernels do not take."""
    v = jnp.concatenate([x[:, None], pooled], axis=1)
    i, j = np.triu_indices(v.shape[1], 1)
    return jnp.concatenate([x, jnp.einsum("bid,bjd->bij", v, v)[:, i, j]], axis=1)


def dot_interaction(x: jax.Array, pooled: jax.Array) -> jax.Array:
    """DLRM's interaction of the dense vector ``x`` (B, d) with the pooled rows ``pooled``
    (B, T, d): ``(B, d + n (n - 1) / 2)``, ``x`` then the dot product of every pair ``i < j``
    of the ``n = T + 1`` vectors (``numpy.triu_indices`` order), what the top MLP takes.

    Differentiable in both inputs, inside ``jax.jit`` and ``jax.shard_map`` (a sharded batch
    gives each device its own rows). float32 and float64 run the core's op: on a GPU one
    kernel forward and one backward on XLA's stream, recordable into XLA's command buffers,
    each sum in a fixed order (two runs give the same bits, where XLA's einsum and the
    gather's transpose need not); on the CPU NumPy. Other dtypes, and shapes past the
    kernels' shared memory (:func:`xferlib.interaction.fits_gpu_kernels`), run the einsum
    form below instead, on every backend, at JAX's matmul precision (``float32`` einsums on
    a GPU take TF32 unless ``jax.default_matmul_precision("highest")``). Equal to

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> x, pooled = jnp.ones((4, 8)), jnp.arange(96.0).reshape(4, 3, 8) / 96
    >>> v = jnp.concatenate([x[:, None], pooled], axis=1)
    >>> i, j = np.triu_indices(4, 1)
    >>> plain = jnp.concatenate([x, jnp.einsum("bid,bjd->bij", v, v)[:, i, j]], axis=1)
    >>> bool(jnp.allclose(dot_interaction(x, pooled), plain, atol=1e-5))
    True
    """
    x, pooled = jnp.asarray(x), jnp.asarray(pooled)
    core.check_shapes(x.shape, pooled.shape)
    if x.dtype != pooled.dtype:
        raise TypeError(f"dot_interaction: x and pooled must have one dtype; got {x.dtype} "
                        f"and {pooled.dtype}")
    B, T, d = pooled.shape
    if x.dtype not in _KERNEL_DTYPES or not core.fits_gpu_kernels(T, d, np.dtype(x.dtype)):
        return _plain(x, pooled)
    return _dot_interaction(x, pooled)
