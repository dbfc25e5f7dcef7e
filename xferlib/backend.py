"""Which array namespace an array belongs to, whether a GPU with CuPy is here, and the stream
helpers: the part of ``xferlib._backend`` that adapters and users may rely on."""

from xferlib._backend import (ExternalStream, array_module, as_cupy_stream, cupy_available,
                              is_capturing, is_cupy_array, is_numpy_array, namespace_name,
                              relaxed_capture_mode, require_cupy, stream_scope)

__all__ = ["is_numpy_array", "is_cupy_array", "namespace_name", "array_module",
           "cupy_available", "require_cupy", "ExternalStream", "as_cupy_stream",
           "stream_scope", "is_capturing", "relaxed_capture_mode"]
