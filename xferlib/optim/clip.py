"""Global-norm gradient clipping over flat buffers, computed where the buffers live.

>>> import numpy as np
>>> from xferlib.optim.clip import clip_by_global_norm
>>> g = np.full(4, 3.0, np.float32)           # norm 6
>>> round(float(clip_by_global_norm([g], 3.0)), 3), g.round(3).tolist()
(6.0, [1.5, 1.5, 1.5, 1.5])
"""

from __future__ import annotations

import numpy as np

from xferlib._backend import array_module, is_cupy_array

__all__ = ["global_norm", "partial_norm", "clip_coefficient", "global_norm_clip_factor",
           "clip_by_global_norm"]


def _partial_norm(grads, norm_type: float):
    """Per-buffer part of a global norm: max |g| (inf norm) or sum |g|^p, as a 0-d array."""
    if not norm_type > 0:  # 0, negative, -inf and NaN are no norms to clip by
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")
    xp = array_module(grads)
    g = grads.astype(xp.float32, copy=False)
    if norm_type == float("inf"):
        return xp.abs(g).max() if g.size else xp.zeros((), xp.float32)
    return xp.sum(xp.abs(g) ** norm_type)


def _total_norm(buffers, norm_type: float):
    """The norm over several flat buffers, as a 0-d array; no host sync unless the buffers
    live in different namespaces (NumPy and CuPy)."""
    partials = [_partial_norm(g, norm_type) for g in buffers]
    namespaces = {array_module(g) for g in buffers}
    xp = namespaces.pop() if len(namespaces) == 1 else np
    if xp is np:
        partials = [np.float32(float(v)) for v in partials]
    stacked = xp.stack([xp.asarray(v, dtype=xp.float32) for v in partials])
    if norm_type == float("inf"):
        return stacked.max()
    return stacked.sum() ** (1.0 / norm_type)


def partial_norm(grads, norm_type: float = 2.0):
    """One buffer's share of a global norm, a 0-d array where ``grads`` lives: ``sum |g|^p``
    (``max |g|`` for the inf norm). Shares of several buffers or processes combine by sum
    (max), then ``** (1 / p)``: how a sharded optimizer gets the norm of all gradients."""
    return _partial_norm(grads, float(norm_type))


def global_norm(grads, norm_type: float = 2.0) -> float:
    """The norm of all gradients in a flat buffer (padding is zero, so it does not count)."""
    return float(_total_norm([grads], norm_type))


def _stream_context(buffers, stream):
    from xferlib._backend import stream_scope

    return stream_scope(stream, any(is_cupy_array(g) for g in buffers))


def global_norm_clip_factor(buffers, max_norm: float, norm_type: float = 2.0,
                            eps: float = 1e-6, *, stream=None):
    """``(total_norm, factor)`` over flat gradient buffers, both computed where the buffers
    live (no host sync on the GPU): ``factor = min(1, max_norm / (total_norm + eps))``, as
    torch.nn.utils.clip_grad_norm_. The gradients are not touched: hand ``factor`` to a
    fused update (``apply_adam_device_scalars(grad_mul=...)``) to clip without a pass of
    its own, or use :func:`clip_by_global_norm`."""
    buffers = list(buffers)
    if not buffers:
        raise ValueError("clipping needs at least one gradient buffer")
    with _stream_context(buffers, stream):
        total = _total_norm(buffers, float(norm_type))
        xp = array_module(total)
        factor = xp.minimum(xp.asarray(max_norm / (total + eps), dtype=xp.float32),
                            xp.float32(1.0))
    return total, factor


def clip_by_global_norm(buffers, max_norm: float, norm_type: float = 2.0, eps: float = 1e-6,
                        *, stream=None):
    """Scale flat gradient buffers in place so their joint norm is at most ``max_norm``,
    with :func:`clip_coefficient`'s factor computed on the device (no host sync): one
    reduction per buffer and one in-place scale. Returns the norm before clipping (0-d)."""
    buffers = list(buffers)
    total, factor = global_norm_clip_factor(buffers, max_norm, norm_type, eps, stream=stream)
    with _stream_context(buffers, stream):
        for g in buffers:
            xp = array_module(g)
            coef = xp.asarray(factor)
            if g.dtype == np.float32:
                g *= coef
            else:  # 16-bit gradients: scale in float32, round once
                g[...] = (g.astype(xp.float32) * coef).astype(g.dtype)
    return total


def clip_coefficient(total_norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: ``min(1, max_norm / (total_norm + eps))``."""
    return min(1.0, max_norm / (total_norm + eps))
