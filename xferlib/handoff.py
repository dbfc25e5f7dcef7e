"""Hand arrays between NumPy, CuPy, PyTorch and JAX, without copies wherever DLPack allows.

``to_numpy``, ``to_cupy``, ``to_torch`` and ``to_jax`` take any of the four array kinds.
Conversion always goes through the *consumer's* ``from_dlpack`` (never by calling
``__dlpack__`` by hand), so the consumer names its stream and the producer orders its pending
work before the handoff.

``copy`` is the same in each function: ``None`` (default) shares memory where the consumer can
see the producer's memory on the same device, and copies otherwise; ``True`` always copies;
``False`` never copies and raises ``BufferError`` where sharing is impossible.

================  ==========  ==========  =================  =========================
from \\ to         numpy       cupy        torch              jax
================  ==========  ==========  =================  =========================
numpy             same        copy (1)    shared (CPU)       shared (CPU) (3)(5)
cupy              copy        same        shared (CUDA)      shared (GPU)
torch CPU         shared      copy (1)    same               shared (CPU) (3)
torch CUDA        copy        shared      same               shared (GPU)
jax CPU           shared (4)  copy        copy (2)           same
jax GPU           copy        copy (2)    copy (2)           same
================  ==========  ==========  =================  =========================

(1) A *pinned* host array can instead be seen from the GPU without a copy:
    ``to_cupy(pinned, copy=False)`` returns a CuPy array whose kernels read host RAM over PCIe
    (SpeedTorch's mechanism). Pageable memory cannot be aliased: BufferError.
(2) JAX arrays are immutable, but a torch or CuPy view of one is writable: the default copies.
    ``copy=False`` returns the alias; writing through it is undefined behaviour in JAX.
(3) JAX may copy where the buffer is not aligned as XLA requires; ``copy=False`` checks.
    ``to_jax(x, memory_kind="pinned_host")`` places the result in JAX's pinned host memory
    space of the GPU (a copy: XLA owns its pinned buffers).
(4) Read-only, as JAX's own ``np.asarray`` view is.
(5) Except bfloat16, which NumPy cannot export through DLPack: copied.

bfloat16 travels as ``ml_dtypes.bfloat16`` on the NumPy side.
"""

from __future__ import annotations

import sys

import numpy as np

from xferlib._backend import is_cupy_array, require_cupy

__all__ = ["to_numpy", "to_cupy", "to_torch", "to_jax", "array_kind", "data_pointer"]


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_jax(x) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def array_kind(x) -> str:
    """One of ``"numpy"``, ``"cupy"``, ``"torch"``, ``"jax"`` (checked without importing)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_cupy_array(x):
        return "cupy"
    if _is_torch(x):
        return "torch"
    if _is_jax(x):
        return "jax"
    raise TypeError(f"expected a NumPy, CuPy, torch or JAX array, got {type(x).__name__}")


def _on_gpu(x, kind: str) -> bool:
    if kind == "numpy":
        return False
    if kind == "cupy":
        return True
    if kind == "torch":
        return x.device.type == "cuda"
    return _jax_platform(x) == "gpu"


def _jax_platform(x) -> str:
    device = next(iter(x.devices()))
    platform = device.platform
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def data_pointer(x) -> int:
    """The address of ``x``'s first element (for zero-copy checks and kernel launches)."""
    kind = array_kind(x)
    if kind == "numpy":
        return int(x.ctypes.data)
    if kind == "cupy":
        return int(x.data.ptr)
    if kind == "torch":
        return int(x.data_ptr())
    return int(x.unsafe_buffer_pointer())


def _no_copy_possible(src: str, dst: str, why: str):
    raise BufferError(f"cannot hand a {src} array to {dst} without a copy: {why}; "
                      "pass copy=None or copy=True")


# ----------------------------------------------------------------------------- to_numpy


def to_numpy(x, *, copy: bool | None = None) -> np.ndarray:
    """Any array as a NumPy array (host memory). See the module table."""
    kind = array_kind(x)
    if kind == "numpy":
        return x.copy() if copy else x
    if _on_gpu(x, kind):
        if copy is False:
            _no_copy_possible(kind, "numpy", "its data are in GPU memory")
        if kind == "cupy":
            return x.get()
        if kind == "torch":
            return _torch_cpu_to_numpy(x.detach().to("cpu"))
        return np.asarray(x)  # JAX copies device arrays to the host
    if kind == "torch":
        out = _torch_cpu_to_numpy(x.detach())
        return out.copy() if copy else out
    out = np.asarray(x)  # JAX CPU: a read-only view
    return out.copy() if copy else out


def _torch_cpu_to_numpy(t) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: reinterpret the bits
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# ----------------------------------------------------------------------------- to_cupy


def to_cupy(x, *, copy: bool | None = None):
    """Any array as a CuPy array on the GPU. See the module table."""
    cupy = require_cupy()
    kind = array_kind(x)
    if kind == "cupy":
        return x.copy() if copy else x
    if kind == "numpy":
        return _host_to_cupy(x, copy, "numpy")
    if kind == "torch":
        if x.device.type != "cuda":
            return _host_to_cupy(_torch_cpu_to_numpy(x.detach()), copy, "torch CPU")
        out = _torch_cuda_to_cupy(x.detach())
        return out.copy() if copy else out
    if _jax_platform(x) != "gpu":
        if copy is False:
            _no_copy_possible("jax CPU", "cupy", "its data are in host memory owned by XLA")
        return cupy.asarray(np.asarray(x))
    out = cupy.from_dlpack(x)
    return out if copy is False else out.copy()


def _torch_cuda_to_cupy(t):
    import torch

    cupy = require_cupy()
    if t.dtype == torch.bfloat16:  # through the bits: not every CuPy imports bfloat16 DLPack
        import ml_dtypes

        return cupy.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    return cupy.from_dlpack(t)


def _host_to_cupy(x: np.ndarray, copy, src_name: str):
    cupy = require_cupy()
    if copy is False:
        from xferlib.memory import device_pointer, is_gpu_mapped

        if not is_gpu_mapped(x):
            _no_copy_possible(src_name, "cupy", "pageable host memory is out of the GPU's reach "
                              "(pin it with xferlib.pin)")
        memory = cupy.cuda.UnownedMemory(device_pointer(x), x.nbytes, x)
        return cupy.ndarray(x.shape, x.dtype, cupy.cuda.MemoryPointer(memory, 0),
                            strides=x.strides)
    return cupy.asarray(x)


# ----------------------------------------------------------------------------- to_torch


def to_torch(x, *, copy: bool | None = None):
    """Any array as a torch tensor on the array's own device. See the module table."""
    import torch

    kind = array_kind(x)
    if kind == "torch":
        return x.clone() if copy else x
    if kind == "numpy":
        if any(s < 0 for s in x.strides):  # torch tensors have no negative strides
            if copy is False:
                _no_copy_possible("numpy", "torch", "torch tensors have no negative strides")
            x, copy = x.copy(), False  # this copy is the copy asked for
        out = _numpy_to_torch(x)
    elif kind == "cupy":
        out = torch.from_dlpack(x)
    else:
        out = torch.from_dlpack(x)
        if copy is None:
            copy = True  # a writable torch view would break JAX's immutability
    return out.clone() if copy else out


def _numpy_to_torch(x: np.ndarray):
    import torch

    bits = x.view(np.int16) if x.dtype.name == "bfloat16" else x  # no bfloat16 in NumPy's
    if not bits.flags.writeable:  # torch warns on read-only NumPy memory; DLPack shares it
        out = torch.from_dlpack(bits)
    else:
        out = torch.from_numpy(bits)
    return out.view(torch.bfloat16) if bits is not x else out


# ----------------------------------------------------------------------------- to_jax


def to_jax(x, *, copy: bool | None = None, memory_kind: str | None = None):
    """Any array as a JAX array on the array's own device. See the module table.

    ``memory_kind="pinned_host"`` places the result in the GPU's pinned host memory space
    (always a copy).
    """
    import jax
    import jax.numpy as jnp

    kind = array_kind(x)
    if memory_kind is not None:
        if copy is False:
            _no_copy_possible(kind, f"jax ({memory_kind})", "XLA owns its memory spaces")
        device = jax.devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
        return jax.device_put(to_numpy(x) if not _is_jax(x) else x, sharding)
    if kind == "jax":
        return jnp.array(x, copy=True) if copy else x
    if kind == "numpy" and x.dtype.name == "bfloat16":
        if copy is False:  # NumPy cannot export ml_dtypes types through DLPack
            _no_copy_possible("numpy bfloat16", "jax", "NumPy's DLPack export has no bfloat16")
        return jnp.asarray(x)
    if kind == "torch":
        x = x.detach()
    try:
        out = jnp.from_dlpack(x, copy=False if copy is False else None)
    except (ValueError, RuntimeError, BufferError, jax.errors.JaxRuntimeError) as err:
        # XLA takes only compact (C-ordered, aligned) buffers, and NumPy's DLPack export
        # refuses read-only arrays: such a view is copied into one where copies are allowed
        if copy is False:
            _no_copy_possible(kind, "jax", f"XLA refused the buffer ({err})")
        if kind == "cupy" or (kind == "torch" and x.is_cuda):  # a compact copy, same GPU
            out = jnp.from_dlpack(x.contiguous().clone() if kind == "torch" else x.copy())
        else:  # a host array stays on the host, as the zero-copy path leaves it
            host = to_numpy(x, copy=True)
            if not host.dtype.isnative:  # DLPack and XLA take native byte order only
                host = host.astype(host.dtype.newbyteorder("="))
            out = jax.device_put(host, jax.devices("cpu")[0])
    given = str(x.dtype).replace("torch.", "")
    if str(out.dtype) != given:  # without x64 JAX narrows 64-bit types: a converted copy
        if copy is False:
            _no_copy_possible(kind, "jax", f"JAX holds {given} as {out.dtype} (x64 is off)")
        if np.issubdtype(np.dtype(given), np.integer) and not np.array_equal(
                to_numpy(x), np.asarray(out)):
            raise ValueError(f"{given} values that do not fit JAX's {out.dtype} (x64 is off): "
                             f"they would wrap; enable x64 or convert them first")
    if copy and data_pointer(out) == data_pointer(x):
        out = out.copy()  # some JAX releases share memory even when asked to copy
    return out
