"""JAX adapter: xferlib's ops as ``jax.custom_vjp`` functions over ``buffer_callback``.

They run inside ``jax.jit``, ``jax.grad`` and ``lax.scan``: on GPU the core's CUDA kernels
launch on XLA's own stream; on CPU the NumPy path runs on XLA's host buffers in place.
"""

from xferlib.adapters.jax.optim import (
    FlatState,
    flat_adam,
    flat_adamw,
    flat_lion,
    flat_sgd,
    flat_step,
    ravel,
    ravel_like,
)
from xferlib.adapters.jax.errors import CallbackIndexError, CallbackValueError, typed_errors
from xferlib.adapters.jax.collection import (collection_anchor, embedding_bag_collection,
                                             recording_scratch_bytes)
from xferlib.adapters.jax.collection_dist import ShardedCollection
from xferlib.adapters.jax.host import host_lookup, host_update
from xferlib.adapters.jax.interaction import dot_interaction
from xferlib.adapters.jax.rows import gather_rows
from xferlib.adapters.jax.mesh import mesh_barrier, sharded_host_update
from xferlib.adapters.jax.tt import tt_embedding_bag, tt_lookup, tt_update

__all__ = ["CallbackIndexError", "CallbackValueError", "FlatState", "ShardedCollection",
           "collection_anchor",
           "dot_interaction", "embedding_bag_collection", "flat_adam", "flat_adamw",
           "flat_lion", "flat_sgd", "flat_step", "gather_rows", "host_lookup", "host_update",
           "mesh_barrier", "ravel", "ravel_like", "recording_scratch_bytes",
           "sharded_host_update", "tt_embedding_bag",
           "tt_lookup", "tt_update", "typed_errors"]
