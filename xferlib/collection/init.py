"""Tables initialized at memory speed, the same values on the CPU and the GPU.

Weight ``(row, col)`` of a table is a function of the table's stream (from the collection's
seed and the table's position) and of ``row * dim + col`` alone (a counter-based generator:
SplitMix64's finalizer over the counter), so rows can be filled in any chunks, on either
path. ``uniform`` values are bitwise equal on both paths (each operation rounded alike);
``normal`` values (Box-Muller) equal to the last bit of float32 except where the two
libraries' ``log``/``cos`` round a double differently (about one value in 10^8, by one
float32 ulp). The GPU path fills GPU memory with a kernel and host tables chunk by chunk
through GPU memory (kernel, then a copy into pinned RAM at the link's rate).
"""

from __future__ import annotations

import numpy as np

__all__ = ["table_stream", "init_kind", "fill_rows_numpy", "fill_rows_gpu"]

_M1, _M2, _GOLDEN = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
INIT_CHUNK_ELEMENTS = 1 << 24  # rows filled per pass: 64 MB of float32 at a time


def _mix_int(z: int) -> int:
    z = (z + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def table_stream(seed: int, table: int) -> int:
    """The 64-bit stream of table ``table`` of a collection seeded ``seed``."""
    return _mix_int((_mix_int(int(seed) & _MASK) + int(table)) & _MASK)


def init_kind(init):
    """``(kind, a, b)`` of an initializer: 0 zeros, 1 uniform(a, b), 2 normal(mean a, std b).
    ValueError for anything else."""
    if isinstance(init, str):
        init = (init,)
    name = init[0] if isinstance(init, tuple) and init else None
    if name == "zeros" and len(init) == 1:
        return 0, 0.0, 0.0
    if name in ("uniform", "normal") and len(init) == 3:
        try:
            a, b = float(init[1]), float(init[2])
        except (TypeError, ValueError):
            raise ValueError(f"{name} init needs two numbers, got {init!r}") from None
        if not (np.isfinite(a) and np.isfinite(b)):  # NaN passes the checks below
            raise ValueError(f"{name} init needs finite parameters, got ({a}, {b})")
        if name == "uniform" and not a <= b:
            raise ValueError(f"uniform init needs low <= high, got ({a}, {b})")
        if name == "normal" and not b >= 0:
            raise ValueError(f"normal init needs std >= 0, got {b}")
        return (1 if name == "uniform" else 2), a, b
    raise ValueError(f"init must be 'zeros', ('uniform', low, high) or ('normal', mean, std), "
                     f"got {init!r}")


def _mix(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def _weights(kind, a, b, stream, first_row, rows, dim):
    counter = (np.arange(first_row * dim, (first_row + rows) * dim, dtype=np.uint64)
               + np.uint64(stream))
    z1 = _mix(counter)
    if kind == 1:
        u = (z1 >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        return a + (b - a) * u
    u1 = ((z1 >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0 ** -53
    u2 = (_mix(z1) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    return a + b * (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2))


def fill_rows_numpy(block_rows: np.ndarray, layout, init, stream: int, initial: float) -> None:
    """Fill a table's whole ``(num_rows, row_width)`` block on the host, in chunks."""
    kind, a, b = init_kind(init)
    num_rows, dim = block_rows.shape[0], layout.dim
    used = len(layout.slots) * dim + len(layout.row_scalars)
    chunk = max(1, INIT_CHUNK_ELEMENTS // block_rows.shape[1])
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as the kernel's does
        for start in range(0, num_rows, chunk):
            part = block_rows[start:start + chunk]
            part[...] = 0
            if kind:
                values = _weights(kind, a, b, stream, start, part.shape[0], dim)
                part[:, :dim] = values.reshape(part.shape[0], dim)
            part[:, layout.state_offset:layout.state_offset + used] = initial


def fill_rows_gpu(target, layout, init, stream: int, initial: float, dtype_name: str) -> None:
    """Fill a table's ``(num_rows, row_width)`` block: a CuPy array in place, or a pinned
    NumPy array through GPU chunks copied down at the link's rate."""
    import cupy

    from xferlib._kernels import grid_1d
    from xferlib._kernels.collection import INIT, c_type, collection_module

    kind, a, b = init_kind(init)
    num_rows, width = target.shape
    used = len(layout.slots) * layout.dim + len(layout.row_scalars)
    on_device = isinstance(target, cupy.ndarray)
    chunk = num_rows if on_device else max(1, 4 * INIT_CHUNK_ELEMENTS // width)
    scratch = None if on_device else cupy.empty((min(chunk, num_rows), width), target.dtype)
    copy_stream = cupy.cuda.get_current_stream()
    for start in range(0, num_rows, chunk):
        rows = min(chunk, num_rows - start)
        dest = target[start:start + rows] if on_device else scratch[:rows]
        grid, block = grid_1d(rows * width, 256, 65535)
        INIT.launch(collection_module(), (c_type(dtype_name),), grid, block,
                    stream=copy_stream, rows=dest, first_row=start, num_rows=rows,
                    row_width=width, dim=layout.dim, state_offset=layout.state_offset,
                    state_used=used, table_stream=stream, kind=kind, a=a, b=b,
                    initial=initial)
        if not on_device:  # the chunk into pinned RAM; the next kernel waits for the copy
            host = target[start:start + rows]
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, dest.data.ptr, dest.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToHost,
                                          copy_stream.ptr)
    copy_stream.synchronize()
