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

        array = cupy.asarray(buffer)
    else:
        array = np.asarray(buffer)
    dtype = np.dtype(buffer.dtype)
    if array.dtype != dtype:  # bfloat16 arrives as raw 2-byte voids through the array protocols
        array = array.view(dtype)
    return array


def xla_stream(ctx, gpu: bool):
    """XLA's compute stream for this call (None on CPU), as the core takes streams."""
    if not gpu:
        return None
    from xferlib.backend import ExternalStream

    return ExternalStream(ctx.stream)
