"""DLRM's dot interaction: a sample's dense vector and its tables' pooled rows, and the dot
product of every pair of them, in one pass.

For sample ``b`` the ``n = 1 + T`` vectors are ``x[b]`` (the bottom MLP's output, ``d``
values) and the ``T`` pooled rows ``pooled[b, t]`` (``d`` values each). The output row is
``[x[b], v_i . v_j for every i < j]``: ``d + n (n - 1) / 2`` values, the pairs in
``numpy.triu_indices(n, 1)`` order, which is what DLRM's top MLP (and TorchRec's
``InteractionArch``) takes. The backward gives ``dx`` and ``dpooled`` from the output's
gradient, every sum in a fixed order (two runs give the same bits).

Why an op of its own: written with batched matmuls (``cat``, ``bmm`` of ``(B, n, d)`` by its
transpose, a gather of the upper triangle, and their backward: an ``index_add``, two more
``bmm`` and a sum), a DLRM step's interaction is a dozen launches over ``(B, n, n)``
products, and cuBLAS runs these small ``27 x 64 x 27`` products on FP32 FMA kernels even
where TF32 is allowed. These two kernels read each sample's vectors once into shared memory
and write its outputs once; each lane computes a register tile (measured in docs/dlrm.md,
"The dot interaction"). A sample's vectors and pairs must fit 48 KB of shared memory
(float32: ``n = 27`` up to ``d = 400``; :func:`fits_gpu_kernels` says, a ValueError
otherwise).

Like every op of the core: :func:`dot_interaction_reference` (NumPy, float64),
:func:`dot_interaction_fwd` / :func:`dot_interaction_bwd` (NumPy for NumPy arrays, CUDA for
CuPy arrays, outputs into ``out`` arrays the caller may allocate; nothing allocated and no
host sync on the GPU path when they are given, so a CUDA-graph capture can hold a call).
"""

from __future__ import annotations

import numpy as np

from xferlib._backend import as_cupy_stream, namespace_name
from xferlib._kernels.interaction import (COLUMN_GROUPS, DOTI_BWD, DOTI_FWD, interaction_module,
                                          load_width, rows_padded)

__all__ = ["interaction_width", "dot_interaction_reference", "dot_interaction_grad_reference",
           "dot_interaction_fwd", "dot_interaction_bwd", "fits_gpu_kernels", "check_shapes"]

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_MAX_BLOCKS = 65535
_SHARED_BYTES = 48 * 1024  # a block's shared memory without opting in to more
_MAX_WARPS = 8  # samples (warps) per block


def interaction_width(num_tables: int, dim: int) -> int:
    """The output's width for ``num_tables`` pooled rows and a dense vector of ``dim``:
    ``dim + n (n - 1) / 2`` with ``n = num_tables + 1``.

    >>> interaction_width(26, 64)
    415
    """
    n = int(num_tables) + 1
    return int(dim) + n * (n - 1) // 2


def _numpy_output(x, pooled):
    """The output by NumPy in the inputs' dtype (the CPU path; in float64, the reference)."""
    v = np.concatenate([x[:, None, :], pooled], axis=1)
    i, j = np.triu_indices(v.shape[1], 1)
    return np.concatenate([x, (v @ v.transpose(0, 2, 1))[:, i, j]], axis=1)


def _numpy_grads(x, pooled, g):
    """``(dx, dpooled)`` by NumPy in the inputs' dtype: the pair gradients as a symmetric
    ``(n, n)`` matrix per sample, times the sample's vectors."""
    v = np.concatenate([x[:, None, :], pooled], axis=1)
    n, d = v.shape[1], x.shape[1]
    i, j = np.triu_indices(n, 1)
    pair = np.zeros((g.shape[0], n, n), dtype=v.dtype)
    pair[:, i, j] = g[:, d:]
    dv = (pair + pair.transpose(0, 2, 1)) @ v
    return g[:, :d] + dv[:, 0], dv[:, 1:]


def dot_interaction_reference(x, pooled) -> np.ndarray:
    """The output in float64 (NumPy): ``[x, upper triangle of V V^T]`` per sample."""
    return _numpy_output(np.asarray(x, np.float64), np.asarray(pooled, np.float64))


def dot_interaction_grad_reference(x, pooled, g):
    """``(dx, dpooled)`` in float64 (NumPy) for the output gradient ``g``."""
    return _numpy_grads(*(np.asarray(a, np.float64) for a in (x, pooled, g)))


def _check_inputs(x, pooled) -> bool:
    """``x`` (B, d) and ``pooled`` (B, T, d), one float dtype, one namespace (True: CuPy).
    Raises before anything is written."""
    try:
        kind, other = namespace_name(x), namespace_name(pooled)
    except TypeError:
        kind = other = None
    if kind is None or other != kind:
        raise TypeError(f"dot_interaction takes NumPy or CuPy arrays of one kind; got "
                        f"{type(x).__name__} and {type(pooled).__name__}")
    check_shapes(x.shape, pooled.shape)
    if x.dtype not in _DTYPES or pooled.dtype != x.dtype:
        raise TypeError(f"dot_interaction: x and pooled must both be float32 or float64; got "
                        f"{x.dtype} and {pooled.dtype}")
    return kind == "cupy"


def check_shapes(x_shape, pooled_shape) -> None:
    """ValueError unless ``x_shape`` is ``(B, d)`` and ``pooled_shape`` ``(B, T, d)`` (the
    adapters check their own arrays' shapes with it before anything runs)."""
    x_shape, pooled_shape = tuple(x_shape), tuple(pooled_shape)
    if len(x_shape) != 2 or len(pooled_shape) != 3:
        raise ValueError(f"dot_interaction: x must be (B, d) and pooled (B, T, d); got "
                         f"shapes {x_shape} and {pooled_shape}")
    if pooled_shape[0] != x_shape[0] or pooled_shape[2] != x_shape[1]:
        raise ValueError(f"dot_interaction: pooled {pooled_shape} must be (B, T, d) "
                         f"with x's B = {x_shape[0]} and d = {x_shape[1]}")


def _check_array(name, array, shape, like, contiguous=True) -> None:
    """``array`` (an output, or the gradient) in ``like``'s namespace and dtype, of
    ``shape`` (and C-contiguous for an output)."""
    if namespace_name(array) != namespace_name(like) or array.dtype != like.dtype:
        raise TypeError(f"dot_interaction: {name} must be a {namespace_name(like)} "
                        f"{like.dtype} array; got {type(array).__name__} "
                        f"{getattr(array, 'dtype', '')}")
    if tuple(array.shape) != tuple(shape) or (contiguous and not array.flags.c_contiguous):
        raise ValueError(f"dot_interaction: {name} must be{' C-contiguous' if contiguous else ''}"
                         f" of shape {tuple(shape)}; got {tuple(array.shape)}")


def _contiguous(a, gpu):
    if gpu:
        import cupy

        return cupy.ascontiguousarray(a)
    return np.ascontiguousarray(a)


def dot_interaction_fwd(x, pooled, out=None, *, stream=None):
    """``(out, residuals)``: the output ``(B, d + n (n - 1) / 2)`` (see the module) and what
    :func:`dot_interaction_bwd` needs. GPU arrays run one kernel on ``stream``."""
    gpu = _check_inputs(x, pooled)
    (B, d), T = x.shape, pooled.shape[1]
    if out is not None:
        _check_array("out", out, (B, interaction_width(T, d)), x)
    if gpu:  # the shape fits, before anything is written
        per_block, shared = _per_block(T, d, x.dtype, backward=False)
    x, pooled = _contiguous(x, gpu), _contiguous(pooled, gpu)
    if not gpu:
        result = _numpy_output(x, pooled)
        if out is None:
            return result, (x, pooled)
        out[...] = result
        return out, (x, pooled)
    import cupy

    stream = as_cupy_stream(stream)
    with stream:
        if out is None:
            out = cupy.empty((B, interaction_width(T, d)), dtype=x.dtype)
        if B:
            vec = load_width(d, x.itemsize, x, pooled)
            DOTI_FWD.launch(interaction_module(), (_c_type(x.dtype), vec), *_grid(B, per_block),
                            stream=stream, shared_mem=shared, x=x, pooled=pooled, B=B, T=T,
                            d=d, per_block=per_block, out=out)
    return out, (x, pooled)


def dot_interaction_bwd(residuals, g, dx=None, dpooled=None, *, stream=None):
    """``(dx, dpooled)`` for the output gradient ``g`` (B, d + n (n - 1) / 2)."""
    x, pooled = residuals
    gpu = _check_inputs(x, pooled)
    (B, d), T = x.shape, pooled.shape[1]
    _check_array("the gradient", g, (B, interaction_width(T, d)), x, contiguous=False)
    for name, array, shape in (("dx", dx, (B, d)), ("dpooled", dpooled, (B, T, d))):
        if array is not None:
            _check_array(name, array, shape, x)
    if gpu:
        per_block, shared = _per_block(T, d, x.dtype, backward=True)
    g = _contiguous(g, gpu)
    if not gpu:
        gx, gp = _numpy_grads(x, pooled, g)
        if dx is None:
            dx = gx
        else:
            dx[...] = gx
        if dpooled is None:
            dpooled = gp
        else:
            dpooled[...] = gp
        return dx, dpooled
    import cupy

    stream = as_cupy_stream(stream)
    with stream:
        dx = cupy.empty((B, d), dtype=x.dtype) if dx is None else dx
        dpooled = cupy.empty((B, T, d), dtype=x.dtype) if dpooled is None else dpooled
        if B:
            columns = next(c for c in COLUMN_GROUPS if d % c == 0)
            vec = load_width(d, x.itemsize, x, pooled)
            DOTI_BWD.launch(interaction_module(), (_c_type(x.dtype), vec, columns),
                            *_grid(B, per_block), stream=stream, shared_mem=shared, x=x,
                            pooled=pooled, g=g, B=B, T=T, d=d, per_block=per_block, dx=dx,
                            dpooled=dpooled)
    return dx, dpooled


def _c_type(dtype) -> str:
    return "float" if np.dtype(dtype) == np.float32 else "double"


def _sample_bytes(T: int, d: int, dtype, backward: bool) -> int:
    """Shared memory one sample takes: its vectors (``rows_padded(n)`` rows of ``d + 1``)
    and the forward's pairs or the backward's ``G`` (``rows_padded(n)`` rows of
    ``rows_padded(n) + 1``)."""
    n = int(T) + 1
    rows = rows_padded(n)
    words = rows * (int(d) + 1) + (rows * (rows + 1) if backward else n * (n - 1) // 2)
    return words * np.dtype(dtype).itemsize


def _per_block(T: int, d: int, dtype, backward: bool):
    """``(samples per block, shared bytes)``: a warp per sample, as many as 48 KB of shared
    memory holds (at most eight). ValueError when one sample does not fit."""
    per_sample = _sample_bytes(T, d, dtype, backward)
    if per_sample > _SHARED_BYTES:
        raise ValueError(f"dot_interaction: {int(T) + 1} vectors of {d} "
                         f"{np.dtype(dtype).name} values need {per_sample:,} bytes of shared "
                         f"memory a sample; the kernels have {_SHARED_BYTES:,} (fewer tables, "
                         f"a narrower d, or float32)")
    per_block = min(_MAX_WARPS, _SHARED_BYTES // per_sample)
    return per_block, per_block * per_sample


def fits_gpu_kernels(num_tables: int, dim: int, dtype=np.float32) -> bool:
    """Whether the GPU kernels take ``num_tables`` pooled rows and a dense vector of ``dim``
    ``dtype`` values (one sample's rows within 48 KB of shared memory, forward and backward).

    >>> fits_gpu_kernels(26, 64), fits_gpu_kernels(26, 1024)
    (True, False)
    """
    return all(_sample_bytes(num_tables, dim, dtype, backward) <= _SHARED_BYTES
               for backward in (False, True))


def _grid(samples: int, per_block: int):
    """``per_block`` samples (warps) per block; the kernels stride over the rest."""
    blocks = min(_MAX_BLOCKS, -(-int(samples) // per_block))
    return (max(1, blocks),), (32 * per_block,)
