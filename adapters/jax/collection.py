"""``embedding_bag_collection``: an :class:`xferlib.collection.EmbeddingCollection` inside
``jax.jit``, trained when gradients are taken.

JAX never owns the collection (its tables live in pinned host RAM or in GPU memory that
xferlib allocated), so the op is a ``jax.custom_vjp`` over two ``buffer_callback`` calls that
reach it: the forward is the core's pooled lookup, written into XLA's output buffer; the
backward is the core's fused backward + update, run on the pooled gradient. On a GPU backend
the core's kernels launch on XLA's stream; on the CPU backend the NumPy path runs on XLA's
host buffers. Both callbacks are marked as having side effects, so XLA neither drops the
update nor caches, merges or hoists a lookup. The update takes the lookup's output as an
input (unread), so XLA runs it after the lookup even where the pooled gradient does not
depend on the lookup; a later step's (or ``lax.scan`` iteration's) lookup sees it.

The core keeps a ``LookupContext`` (the batch's plan) from a forward for its backward. A JAX
residual must be an array, so the training forward leaves its context with the collection
(``keep_context``), keyed by the addresses of its buffers (indices, offsets, weights, the
pooled output), and the backward, which receives the same buffers, takes it back
(``take_context``). Where an unrecorded backward finds none (XLA moved the buffers, or
more forwards than the collection keeps came between), it runs the core's forward again on
the same ``indices`` / ``offsets`` into a scratch output: the same update, for about one
more forward's time. A backward XLA records finds the context its recorded forward left
(kept for the collection's life), or raises (see ``take_context``).

Gradients reach the collection only through a differentiated input: the lookup's output
depends on no parameter of the model, so ``jax.grad`` of a loss would never ask for its
cotangent. Pass ``anchor`` (:func:`collection_anchor`, a zero-size array kept among the
parameters you differentiate); its gradient is zero-size too, and ignoring it is fine.
"""

from __future__ import annotations

import contextlib
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from xferlib.adapters.jax._callback import (as_core_array, device_scope, is_gpu_buffer,
                                            recordable_scope, recording_pools,
                                            recording_scratch_bytes, xla_stream)
from xferlib.adapters.jax.errors import as_index_array, is_concrete, reporting, typed_errors
from xferlib.adapters.jax.host import fill_token
from xferlib.collection import EmbeddingCollection
from xferlib.collection.numpy_path import check_inputs_numpy

__all__ = ["embedding_bag_collection", "collection_anchor", "recording_scratch_bytes"]


def collection_anchor() -> jax.Array:
    """The zero-size float32 array that makes gradients reach a collection: keep it among the
    parameters you differentiate and pass it as ``anchor=`` (its gradient is zero-size)."""
    return jnp.zeros((0,), jnp.float32)


def _checked(coll, indices, offsets, per_sample_weights):
    """The inputs as JAX arrays, after the checks that need no values (the core's own
    messages: the core checks again inside the callback, where values are known)."""
    if not isinstance(coll, EmbeddingCollection):
        raise TypeError(f"coll must be an xferlib.collection.EmbeddingCollection, got "
                        f"{type(coll).__name__}")
    indices = as_index_array("indices", indices)
    offsets = as_index_array("offsets", offsets, ValueError)
    weights = None if per_sample_weights is None else jnp.asarray(per_sample_weights)
    coll.check_shapes(indices, offsets, weights)
    if is_concrete(indices, offsets):
        # An eager call: offsets and every index against its table on the host now, so a bad
        # batch raises the core's ValueError / IndexError before the op runs (under jit the
        # values exist only inside the callback, which raises there, through XLA).
        check_inputs_numpy(coll, np.asarray(indices), np.asarray(offsets))
    return indices, offsets, weights


# One custom_vjp per (collection, weighted): jit caches its traces by the function object.
_FUNCTIONS: "weakref.WeakKeyDictionary[EmbeddingCollection, dict]" = weakref.WeakKeyDictionary()


def _function(coll: EmbeddingCollection, weighted: bool, record: bool):
    if record:
        # Held by the collection, and holding it: a recorded graph writes the collection's
        # memory without asking for it, so the collection lives as long as JAX keeps a
        # compiled function that uses this op (a cycle, freed once both are unreachable).
        made = coll.__dict__.setdefault("_recorded_jax_functions", {})
        if weighted not in made:
            # tt tables are never recorded (see the docstring)
            pools = None if coll.tt_tables else recording_pools(coll)
            made[weighted] = _make(lambda: coll, weighted, pools)
        return made[weighted]
    made = _FUNCTIONS.setdefault(coll, {})
    if weighted not in made:
        made[weighted] = _make(weakref.ref(coll), weighted, None)
    return made[weighted]


def _make(ref, weighted: bool, pools):
    """The custom_vjp for the collection ``ref()`` (held weakly unless recorded: the cache
    must not keep a collection and its tables alive). ``pools``: a dict for the private
    CuPy pools of GPU callbacks XLA may record into its command buffers (device -> pool,
    see ``recordable_scope``); None: never recorded."""
    record = pools is not None

    def scope(ctx, gpu):
        return recordable_scope(pools, ctx, gpu) if record else contextlib.nullcontext(False)

    def core_inputs(buffers, gpu):
        arrays = [as_core_array(b, gpu) for b in buffers]
        return arrays[0], arrays[1], arrays[2] if weighted else None

    def collection_for(gpu: bool) -> EmbeddingCollection:
        coll = ref()
        if gpu != (coll.device == "cuda"):  # said in JAX's terms, before the core refuses
            raise TypeError(f"this collection was built with device={coll.device!r} but JAX "
                            f"runs the call on {'a GPU' if gpu else 'the CPU'}: build it with "
                            f"device={'cuda' if gpu else 'cpu'!r}")
        return coll

    @reporting
    def forward_callback(ctx, out, *buffers):
        gpu = is_gpu_buffer(out)
        with device_scope(gpu, out, buffers[0]), scope(ctx, gpu):
            indices, offsets, weights = core_inputs(buffers, gpu)
            collection_for(gpu).lookup(indices, offsets, weights,
                                       out=as_core_array(out, gpu),
                                       stream=xla_stream(ctx, gpu))

    @reporting
    def training_forward_callback(ctx, out, *buffers):
        gpu = is_gpu_buffer(out)
        with device_scope(gpu, out, buffers[0]), scope(ctx, gpu) as recording:
            indices, offsets, weights = core_inputs(buffers, gpu)
            coll, pooled_out = collection_for(gpu), as_core_array(out, gpu)
            _, lookup = coll.forward(indices, offsets, weights, out=pooled_out,
                                     stream=xla_stream(ctx, gpu))
            coll.keep_context(_buffer_key(indices, offsets, weights, pooled_out), lookup,
                              recording)

    @reporting
    def update_callback(ctx, token, *buffers):
        # buffers: indices, offsets, [weights], the forward's output (unread), the gradient
        gpu = is_gpu_buffer(token)
        with device_scope(gpu, token, buffers[0]), scope(ctx, gpu) as recording:
            coll, stream = collection_for(gpu), xla_stream(ctx, gpu)
            indices, offsets, weights = core_inputs(buffers[:-2], gpu)
            pooled_out = as_core_array(buffers[-2], gpu)
            lookup = coll.take_context(_buffer_key(indices, offsets, weights, pooled_out),
                                       recording)
            if lookup is None:  # the forward's context is gone: plan the batch again
                _, lookup = coll.forward(indices, offsets, weights, stream=stream)
            coll.backward(lookup, as_core_array(buffers[-1], gpu), stream=stream)
            fill_token(ctx, token, gpu)

    def pooled(indices, offsets, weights, callback=forward_callback):
        coll = ref()
        B = (offsets.shape[0] - 1) // coll.num_tables
        out_type = jax.ShapeDtypeStruct((B, coll.total_dim), coll.dtype)
        extra = (weights,) if weighted else ()
        return buffer_callback(callback, out_type, has_side_effect=True,
                               command_buffer_compatible=record)(indices, offsets, *extra)

    @jax.custom_vjp
    def function(anchor, indices, offsets, weights):
        return pooled(indices, offsets, weights)

    def fwd(anchor, indices, offsets, weights):
        out = pooled(indices, offsets, weights, training_forward_callback)
        return out, (anchor, indices, offsets, weights, out)

    def bwd(residuals, g):
        anchor, indices, offsets, weights, out = residuals
        extra = (weights,) if weighted else ()
        token_type = jax.ShapeDtypeStruct((), np.int32)
        # The forward's output is an input of the update, unread: the one data dependence
        # that makes XLA run the update after the lookup. The pooled gradient alone does not
        # (the gradient of sum(pooled * w) is w: the update could run first, and the lookup
        # would read updated rows). Nothing reads the token: the side effect keeps the update.
        buffer_callback(update_callback, token_type, has_side_effect=True,
                        command_buffer_compatible=record)(
            indices, offsets, *extra, out, g.astype(ref().dtype))
        return (jnp.zeros_like(anchor), np.zeros(indices.shape, jax.dtypes.float0),
                np.zeros(offsets.shape, jax.dtypes.float0),
                None if weights is None else jnp.zeros_like(weights))

    function.defvjp(fwd, bwd)
    return function


def _buffer_key(indices, offsets, weights, out) -> tuple:
    """A batch's key between its forward and backward callbacks: where the forward's
    buffers lie, and their lengths (residuals keep them alive, so no other batch has
    these). Every buffer the forward reads or writes, as XLA keys its recordings: two
    recordings of the forward differ in one of them at least."""
    def address(a):
        if a is None:
            return None
        # NumPy's .data is a memoryview, which refuses some dtypes (bfloat16): ask ctypes
        return (a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr), a.shape[0]
    return address(indices), address(offsets), address(weights), address(out)


def embedding_bag_collection(coll: EmbeddingCollection, indices, offsets,
                             per_sample_weights=None, *, anchor=None,
                             record: bool = False) -> jax.Array:
    """The pooled lookup of every table of ``coll``: ``(B, total_dim)`` in the collection's
    dtype, table ``t`` at columns ``coll.dim_offsets[t]:coll.dim_offsets[t + 1]``; usable
    inside ``jax.jit``, ``jax.grad`` and ``lax.scan``.

    ``indices``, ``offsets``, ``per_sample_weights``: FBGEMM's layout, as
    :meth:`EmbeddingCollection.forward` takes it (``offsets`` of ``T * B + 1``; int32 or
    int64; the per-table dict form goes through ``coll.pack`` first). The per-sample weights
    scale rows before the pooling and get no gradient (``stop_gradient``: differentiating
    with respect to them alone gives zeros and trains nothing).

    ``anchor``: :func:`collection_anchor`'s array, among the parameters you differentiate.
    Differentiating a loss with respect to it runs the collection's fused backward + update
    (its optimizer on every looked-up row, in place) and gives a zero-size gradient. Without
    it the call is a lookup only. The collection lives on one device: ``device="cpu"`` for
    JAX's CPU backend, ``"cuda"`` for its GPU backend (float32 rows, unless JAX runs with
    x64); a call on the other raises TypeError.

    ``record`` (GPU): let XLA record the op's kernels into its command buffers (CUDA graphs)
    and replay them without calling back into Python: a jitted step then costs little
    more host time than XLA's own launches. Replays happen while the buffers the op reads
    stay where they were (slice each step's batch out of a chunk inside the jitted step).
    Made for one lookup of the collection per step; with it the collection lives as long
    as JAX keeps a compiled function that uses it; ``tt`` tables are never recorded; a
    ``coll.check()`` after replays reads the last replay's input check. Off by default
    (see docs/collection.md, "Replayed from XLA's command buffers").

    Bad input raises the core's errors before any table changes: TypeError / ValueError for
    dtypes and shapes at once; offsets and indices out of range in an eager call (concrete
    arrays) at once, as the core's ValueError / IndexError; under ``jit`` from the callback
    as XLA's runtime error, which :func:`~xferlib.adapters.jax.typed_errors` raises as
    :class:`~xferlib.adapters.jax.CallbackIndexError` / ``CallbackValueError`` with the
    core's message ("index 9 at position 1 is out of range for table 't0' ..."). On a GPU
    the check is read without a host sync: the error comes from a later call or
    ``coll.check()``.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from xferlib.collection import EmbeddingCollection, TableConfig
    >>> from xferlib.adapters.jax import collection_anchor, embedding_bag_collection
    >>> device = "cuda" if jax.default_backend() == "gpu" else "cpu"  # where JAX runs
    >>> coll = EmbeddingCollection([TableConfig(10, 4, init="zeros"),
    ...                             TableConfig(20, 2, init="zeros")],
    ...                            "sgd", {"lr": 1.0}, device=device)
    >>> indices = jnp.array([1, 1, 3, 5])      # table 0: bags [1, 1], [3]; table 1: [5], []
    >>> offsets = jnp.array([0, 2, 3, 4, 4])   # T * B + 1 = 2 * 2 + 1
    >>> def loss(anchor):
    ...     return embedding_bag_collection(coll, indices, offsets, anchor=anchor).sum()
    >>> _ = jax.jit(jax.grad(loss))(collection_anchor())  # SGD on rows 1, 3 (t0) and 5 (t1)
    >>> coll.weights(0)[1].tolist()          # looked up twice: -2
    [-2.0, -2.0, -2.0, -2.0]
    """
    indices, offsets, weights = _checked(coll, indices, offsets, per_sample_weights)
    if weights is not None:  # no gradient for them: differentiating them alone trains nothing
        weights = jax.lax.stop_gradient(weights)
    function = _function(coll, weights is not None, bool(record))
    if anchor is None:  # nothing differentiable reaches the op: a lookup alone
        anchor = collection_anchor()
    with typed_errors():  # an eager call runs here; under jit this only traces
        return function(anchor, indices, offsets, weights)
