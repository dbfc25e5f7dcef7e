"""Seeing ``buffer_callback`` buffers as the core's arrays, on the stream XLA runs."""

from __future__ import annotations

import numpy as np


def is_gpu_buffer(buffer) -> bool:
    try:
        buffer.__cuda_array_interface__
    except Exception:  # CPU buffers have no CUDA interface
        return False
    return True


def as_core_array(buffer, gpu: bool):
    """A zero-copy NumPy (CPU) or CuPy (GPU) view of an XLA buffer."""
    if gpu:
        import cupy

        return cupy.asarray(buffer)
    return np.asarray(buffer)


def xla_stream(ctx, gpu: bool):
    """XLA's compute stream for this call (None on CPU), as the core takes streams."""
    if not gpu:
        return None
    from xferlib._backend import ExternalStream

    return ExternalStream(ctx.stream)
