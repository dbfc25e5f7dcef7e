"""Seeing ``buffer_callback`` buffers as the core's arrays, on the stream XLA runs."""

from __future__ import annotations

import contextlib

import jax
import numpy as np


def is_gpu_buffer(buffer) -> bool:
    try:
        buffer.__cuda_array_interface__
    except Exception:  # CPU buffers have no CUDA interface
        return False
    return True


def as_core_array(buffer, gpu: bool):
    """A zero-copy NumPy (CPU) or CuPy (GPU) view of an XLA buffer."""
    array = _cupy_view(buffer) if gpu else np.asarray(buffer)
    dtype = np.dtype(buffer.dtype)
    if array.dtype != dtype:  # bfloat16 arrives as raw 2-byte voids through the array protocols
        array = array.view(dtype)
    return array


def _cupy_view(buffer):
    """The CuPy view of a GPU buffer, built from its array interface and DLPack device
    (``cupy.asarray`` asks the driver which device holds the pointer: a call per buffer,
    several per step of a jitted model; XLA's buffers are dense, row-major)."""
    import cupy

    interface = buffer.__cuda_array_interface__
    if interface.get("strides") is not None or not hasattr(buffer, "__dlpack_device__"):
        return cupy.asarray(buffer)
    dtype = np.dtype(interface["typestr"])
    shape = tuple(interface["shape"])
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if nbytes == 0:  # an empty buffer may carry a null pointer
        return cupy.empty(shape, dtype)
    memory = cupy.cuda.UnownedMemory(interface["data"][0], nbytes, buffer,
                                     buffer_device(buffer))
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


def xla_stream(ctx, gpu: bool):
    """XLA's compute stream for this call (None on CPU), as the core takes streams."""
    if not gpu:
        return None
    from xferlib.backend import ExternalStream

    return ExternalStream(ctx.stream)


def buffer_device(*buffers) -> int:
    """The CUDA device ordinal the GPU buffers live on (under ``shard_map`` each device's
    callback gets its own device's buffers, and CuPy must launch there)."""
    import cupy

    for buffer in buffers:
        if hasattr(buffer, "__dlpack_device__"):  # XLA's buffers say where they live
            return int(buffer.__dlpack_device__()[1])
        pointer = buffer.__cuda_array_interface__["data"][0]
        if pointer:  # an empty buffer may carry a null pointer
            return int(cupy.cuda.runtime.pointerGetAttributes(pointer).device)
    return int(cupy.cuda.runtime.getDevice())


@contextlib.contextmanager
def callback_scope(ctx, gpu: bool, *buffers):
    """A callback's device (the buffers': under shard_map, each device's own), then XLA's
    stream as CuPy's current one, so every GPU op of the callback queues there."""
    from xferlib.backend import stream_scope

    with device_scope(gpu, *buffers), stream_scope(xla_stream(ctx, gpu), gpu):
        yield


def device_scope(gpu: bool, *buffers):
    """A ``with`` context making the buffers' GPU CuPy's current device (a no-op on CPU)."""
    if not gpu:
        import contextlib

        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(buffer_device(*buffers))


def varying_axes(*values) -> frozenset:
    """The mesh axes along which any of ``values`` varies inside ``jax.shard_map`` (empty
    outside it, and with ``check_vma=False``). JAX types a ``buffer_callback``'s outputs as
    the same on every device, which they are not when they depend on a sharded batch."""
    axes = set()
    for value in values:
        if value is None:
            continue
        aval = jax.typeof(value)
        vma = getattr(aval, "vma", None)
        if vma is None:  # JAX >= 0.10 keeps it in the manual axis type
            vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
        axes.update(vma)
    return frozenset(axes)


def vary_like(x, *deps):
    """``x`` typed as varying wherever ``deps`` vary (its values unchanged): adds a zero that
    depends on them, so JAX's own rules type the result (any JAX version, ``check_vma`` on or
    off) and differentiating w.r.t. the result gives each device its own gradient."""
    zero = None
    for dep in deps:
        if dep is None or dep.size == 0:
            continue
        term = (dep.reshape(-1)[0] * 0).astype(x.dtype)
        zero = term if zero is None else zero + term
    return x if zero is None else x + zero


def recording_pools(owner) -> dict:
    """A new dict for the private CuPy pools of ``owner``'s recorded callbacks (device ->
    pool, filled by :func:`private_pool`), registered on ``owner`` (a collection) so that
    :func:`recording_scratch_bytes` counts it."""
    pools = {}
    owner.__dict__.setdefault("_recorded_jax_pools", []).append(pools)
    return pools


def recording_scratch_bytes(coll) -> int:
    """GPU memory held for the recorded calls (``record=True``) of ``coll``, an
    :class:`~xferlib.collection.EmbeddingCollection` or a
    :class:`~xferlib.adapters.jax.ShardedCollection` (this process's shards): their scratch,
    in CuPy pools of their own (neither JAX's allocator nor CuPy's default pool counts it)."""
    return sum(int(pool.total_bytes()) for pools in coll.__dict__.get("_recorded_jax_pools", ())
               for pool in pools.values())


def private_pool(owner: dict, device: int):
    """The CuPy memory pool of ``owner``'s callbacks on ``device`` (made on first use; kept in
    ``owner``, a dict the callbacks' closure holds). Its blocks are never given back: see
    :func:`_malloc_keeping_blocks`."""
    pool = owner.get(device)
    if pool is None:
        import cupy

        pool = owner[device] = cupy.cuda.MemoryPool(_malloc_keeping_blocks)
    return pool


_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation (not exposed by CuPy's runtime)


def _malloc_keeping_blocks(size: int):
    """A new device allocation for a recordings' pool. Where CUDA has no memory left, CuPy's
    pool, seeing CUDA's own error, would free its cached blocks to the driver and try again,
    and a block a recorded graph still writes at every replay would go to whoever allocates
    next: it is raised as CuPy's OutOfMemoryError instead, which the pool passes on."""
    import cupy

    try:
        return cupy.cuda.MemoryPointer(cupy.cuda.Memory(size), 0)
    except cupy.cuda.runtime.CUDARuntimeError as err:
        if err.status != _CUDA_ERROR_MEMORY_ALLOCATION:
            raise
        raise cupy.cuda.memory.OutOfMemoryError(size, -1) from err


@contextlib.contextmanager
def recordable_scope(pools: dict, ctx, gpu: bool):
    """Inside, a GPU callback may be recorded into one of XLA's command buffers (CUDA graphs
    replayed without calling the callback again): CuPy allocates the callback's scratch
    from ``pools``' private pool, and while XLA records, this thread may allocate memory
    (CUDA's relaxed capture mode).

    The private pool is what keeps a recording valid: a replay writes and reads the
    addresses the recording saw, so no other code may be handed that memory. Only this
    owner's callbacks allocate from it, one after another on XLA's stream, and each
    recording's scratch is used within its own replay; the pool's blocks live as long as
    ``pools`` (the callbacks' closure), so a replay never touches memory given back. The
    first calls with a batch shape grow the pool; a recording at that shape then finds
    its blocks there. Yields whether XLA is recording this call."""
    if not gpu:
        yield False
        return
    import cupy

    from xferlib.backend import as_cupy_stream, is_capturing, relaxed_capture_mode

    stream = as_cupy_stream(xla_stream(ctx, gpu))
    pool = private_pool(pools, int(cupy.cuda.runtime.getDevice()))
    with cupy.cuda.using_allocator(pool.malloc):
        if is_capturing(stream):
            with relaxed_capture_mode():
                yield True
        else:
            yield False
