"""Row transfer primitives: unique/sort, gather, scatter and scatter-add of table rows.

A *table* is a 2-D array whose rows are contiguous: a NumPy array (pinned or not), or a CuPy
array on the GPU. *Indices* are a 1-D int32 or int64 array on the host or the GPU.

Where the work runs follows the arrays, never a global flag:

=====================  ================  ==================================================
table                  indices / src     path
=====================  ================  ==================================================
NumPy                  NumPy             NumPy (vectorized; what CPU machines run)
pinned NumPy           CuPy              zero-copy CUDA kernel reading/writing host RAM
CuPy                   NumPy or CuPy     CUDA kernel (host indices are uploaded first)
pageable NumPy         CuPy              NumPy, with the rows moved through the host (slow)
=====================  ================  ==================================================

:func:`gather_rows` returns its rows on the GPU when the indices (or ``out``) are on the GPU
or the table is, else as NumPy. GPU work is queued on ``stream`` (default: CuPy's current
stream); synchronize that stream before reading a pinned table from NumPy after a scatter.

Every function checks its input before it touches anything: wrong dtypes raise TypeError,
wrong shapes ValueError, at once. An index outside ``[0, num_rows)`` raises IndexError naming
the first bad position, its value and the table size: on the CPU path before anything is
written; on the GPU path the check runs on the device (in the fused kernel itself, whose
every block checks every index before it writes; or in the sort kernel queued before the row
kernel), a bad batch writes nothing, and the verdict (16 bytes) reaches pinned host memory
without a host sync. It is read by a later GPU call of this module (which raises before it
queues anything; at the latest once four calls are pending) or by :func:`check_rows`, which
waits for every pending verdict. So a GPU call costs no round trip: the host queues the next
one while the device works, and a bad batch writes nothing and raises soon after. GPU calls
can also be captured in a CUDA graph (all buffers depend on the batch size only; capture
after one eager call): after replays, synchronize and call :func:`check_rows`, which reads
the verdicts the replays wrote. This is the checking policy of :mod:`xferlib.batch`, with one
queue of pending checks per device.

The one-launch (fused) path, the table check and the pending-check queues live in
:mod:`xferlib.rows_fused`; this module is the API and the planned path.
"""

from __future__ import annotations

import numpy as np

from xferlib._backend import as_cupy_stream, is_cupy_array, namespace_name
from xferlib.batch import RowsReport, index_error, plan_batch
from xferlib.perf import warn_slow_rows_path
from xferlib.rows_fused import (INDEX_DTYPES as _INDEX_DTYPES, check_table as _check_table,
                                 device_address as _device_address, fused as _fused,
                                 is_gpu_reachable as _is_gpu_reachable,
                                 pending_checks as _checks, poll_checks as _poll_checks,
                                 word_bytes as _word_bytes)

__all__ = [
    "unique_indices",
    "gather_rows",
    "scatter_rows",
    "scatter_add_rows",
    "gather_rows_fwd",
    "gather_rows_bwd",
    "gather_rows_reference",
    "check_rows",
    "scatter_rows_reference",
    "scatter_add_rows_reference",
]

_ADD_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")


# ----------------------------------------------------------------------------- references


def gather_rows_reference(table, idx) -> np.ndarray:
    """``table[idx]`` in float64: the oracle for :func:`gather_rows`."""
    return np.asarray(table, dtype=np.float64)[np.asarray(idx)]


def scatter_rows_reference(table, idx, src) -> np.ndarray:
    """A float64 copy of ``table`` with ``table[idx[i]] = src[i]``; for a repeated index the
    last position wins: the oracle for :func:`scatter_rows`."""
    out = np.array(table, dtype=np.float64)
    idx = np.asarray(idx)
    rows, first_from_end = np.unique(idx[::-1], return_index=True)
    out[rows] = np.asarray(src, dtype=np.float64)[len(idx) - 1 - first_from_end]
    return out


def scatter_add_rows_reference(table, idx, src) -> np.ndarray:
    """A float64 copy of ``table`` with every ``src[i]`` added to row ``idx[i]``: the oracle
    for :func:`scatter_add_rows`."""
    out = np.array(table, dtype=np.float64)
    np.add.at(out, np.asarray(idx), np.asarray(src, dtype=np.float64))
    return out


# ----------------------------------------------------------------------------- validation


def check_index_dtype(idx) -> None:
    namespace_name(idx)
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"indices must be int32 or int64, got {idx.dtype}")
    if idx.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {idx.shape}")


def check_host_indices(idx: np.ndarray, num_rows: int) -> None:
    bad = (idx < 0) | (idx >= num_rows)
    if bad.any():
        position = int(np.argmax(bad))
        raise index_error(position, int(idx[position]), num_rows)


def _check_host_order(idx: np.ndarray) -> None:
    """The ``sorted_indices=True`` promise, checked on host indices."""
    descending = np.flatnonzero(idx[1:] < idx[:-1])
    if descending.size:
        position = int(descending[0]) + 1
        raise ValueError(f"sorted_indices=True, but index {int(idx[position])} at position "
                         f"{position} comes after {int(idx[position - 1])}; nothing was written")


def _check_writable(array, name: str) -> None:
    """A NumPy array the call writes must be writable (NumPy's own error names no argument,
    or speaks of WRITEBACKIFCOPY)."""
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        raise ValueError(f"{name} is read-only; nothing was written (pass a writable array, "
                         f"e.g. a copy)")


def _check_add_dtype(table) -> None:
    if _dtype_name(table.dtype) not in _ADD_DTYPE_NAMES:
        raise TypeError(f"scatter_add_rows needs a float32, float64, float16 or bfloat16 "
                        f"table, got {table.dtype}")


def _check_rows_arg(rows, name: str, table, num_indices: int) -> None:
    namespace_name(rows)
    if rows.dtype != table.dtype:
        raise TypeError(f"{name} dtype {rows.dtype} does not match the table dtype {table.dtype}")
    expected = (num_indices, table.shape[1])
    if rows.shape != expected:
        raise ValueError(f"{name} must have shape {expected}, got {rows.shape}")
    if num_indices and rows.shape[1] > 1 and rows.strides[1] != rows.dtype.itemsize:
        raise ValueError(f"{name} rows must be contiguous (strides {rows.strides})")


# ----------------------------------------------------------------------------- unique


def unique_indices(idx):
    """Unique sorted indices and, for each input position, its position among them.

    ``unique[inverse] == idx``. Returns arrays of the same namespace as ``idx``.
    """
    check_index_dtype(idx)
    if is_cupy_array(idx):
        import cupy

        unique, inverse = cupy.unique(idx, return_inverse=True)
    else:
        unique, inverse = np.unique(idx, return_inverse=True)
    return unique, inverse.reshape(-1)


# ----------------------------------------------------------------------------- GPU helpers


def check_rows() -> None:
    """Wait for the index checks of every GPU gather/scatter queued so far and raise the
    first failure (IndexError for an index outside the table, ValueError for a broken
    ``sorted_indices`` promise). A rejected call wrote nothing.

    GPU calls do not wait for their own check (see the module docstring and
    :mod:`xferlib.batch`); call this where the error must surface at a known point, e.g.
    before reading results on the host.

    >>> import numpy as np, xferlib
    >>> xferlib.rows.check_rows()  # nothing pending on the CPU path
    """
    _poll_checks(wait=True)


def _launch_sorted_kernel(kind: str, table, plan, rows, stream) -> None:
    """Launch the gather ("gather"), scatter ("scatter") or scatter-add ("add") kernel over
    the planned batch. ``rows`` is ``out`` or ``src``: a CuPy or pinned NumPy array."""
    keys, perm, first_bad = plan.keys, plan.perm, plan.verdict.words
    from xferlib._kernels import launch_config
    from xferlib._kernels.rows import (ADD_TYPES, GATHER_SORTED, KEY_TYPES, ROWS_MODULE,
                                       SCATTER_ADD_SORTED, SCATTER_SORTED, WORD_TYPES)

    table_ptr = _device_address(table, "table")
    rows_ptr = _device_address(rows, "out" if kind == "gather" else "src")
    itemsize = table.dtype.itemsize
    word = _word_bytes(table.shape[1] * itemsize, table.strides[0], rows.strides[0],
                       table_ptr, rows_ptr)
    key_type = KEY_TYPES[keys.dtype.itemsize]
    if kind == "add":
        ctype, pack = ADD_TYPES[_dtype_name(table.dtype)]
        pack = pack if word == 16 else 1
        types = (ctype, pack, key_type)
        unit = itemsize * pack
    else:
        types = (WORD_TYPES[word], key_type)
        unit = word
    n = perm.size
    width = table.shape[1] * itemsize // unit
    group = min(32, 1 << max(0, (width - 1).bit_length()))  # lanes per row
    grid, block = launch_config(-(-n * group // 32))
    table_stride, rows_stride = table.strides[0] // unit, rows.strides[0] // unit
    if kind == "gather":
        GATHER_SORTED.launch(ROWS_MODULE, types, grid, block, stream=stream, table=table_ptr,
                             n_rows=table.shape[0], table_stride=table_stride, width=width,
                             rows=keys, perm=perm, n=n, out=rows_ptr, out_stride=rows_stride,
                             first_bad=first_bad, group=group)
    elif kind == "add":
        SCATTER_ADD_SORTED.launch(ROWS_MODULE, types, grid, block, stream=stream,
                                  table=table_ptr, n_rows=table.shape[0],
                                  table_stride=table_stride, width=width, rows=keys, perm=perm,
                                  n=n, src=rows_ptr, src_stride=rows_stride,
                                  first_bad=first_bad, group=group)
    else:
        SCATTER_SORTED.launch(ROWS_MODULE, types, grid, block, stream=stream, table=table_ptr,
                              n_rows=table.shape[0], table_stride=table_stride, width=width,
                              rows=keys, perm=perm, n=n, src=rows_ptr, src_stride=rows_stride,
                              first_bad=first_bad, group=group)


def to_gpu_indices(idx, num_rows):
    import cupy

    if is_cupy_array(idx):
        return idx
    check_host_indices(idx, num_rows)
    return cupy.asarray(idx)


# ----------------------------------------------------------------------------- gather


def gather_rows(table, idx, out=None, *, stream=None, sorted_indices: bool = False):
    """``out[i] = table[idx[i]]``.

    Args:
      table: 2-D NumPy (pinned for the GPU path) or CuPy array.
      idx: 1-D int32/int64 indices, NumPy or CuPy; duplicates allowed.
      out: optional ``(len(idx), table.shape[1])`` array of the table's dtype; its namespace
        picks where the rows land.
      stream: GPU stream (``None``: CuPy's current stream; an int ``cudaStream_t``, a CuPy
        stream, or anything with ``__cuda_stream__``).
      sorted_indices: the caller promises ``idx`` is ascending (repeats allowed), so the GPU
        path skips its sort; the promise is checked (ValueError, nothing written).

    GPU path, straight from pinned host RAM when the table lives there, with accesses of up
    to 16 bytes per lane: up to :data:`xferlib.rows_fused.FUSED_MAX` CuPy indices take one
    fused launch (no sort; with ``sorted_indices`` each run of equal rows is read once);
    larger batches are sorted first and each distinct row is read once.

    >>> import numpy as np, xferlib
    >>> table = np.arange(12, dtype=np.float32).reshape(4, 3)
    >>> xferlib.gather_rows(table, np.array([3, 0, 3])).tolist()
    [[9.0, 10.0, 11.0], [0.0, 1.0, 2.0], [9.0, 10.0, 11.0]]
    """
    if is_cupy_array(idx):
        fused = _fused("gather", table, idx, out, stream, sorted_indices)
        if fused is not None:
            return fused
    _check_table(table)
    check_index_dtype(idx)
    num_rows, dim = table.shape
    n = idx.shape[0]
    on_gpu = is_cupy_array(idx) or is_cupy_array(table) or (out is not None and is_cupy_array(out))
    if out is not None:
        _check_rows_arg(out, "out", table, n)
        _check_writable(out, "out")
    warn_slow_rows_path("gather_rows", table, idx, out)  # pageable table etc.: warn once
    if not on_gpu:
        check_host_indices(idx, num_rows)
        if sorted_indices:
            _check_host_order(idx)
        return take_rows(np.asarray(table), idx, out)

    cupy = _cupy_for_gpu_path()
    stream = as_cupy_stream(stream)
    _poll_checks()  # an earlier call's bad batch raises here, before anything is queued
    with stream:
        if not _is_gpu_reachable(table):
            # Pageable memory is out of the GPU's reach: gather on the host, then upload.
            host_idx = cupy.asnumpy(idx) if is_cupy_array(idx) else idx
            rows = gather_rows(table, host_idx, sorted_indices=sorted_indices)
            if out is None:
                return cupy.asarray(rows)
            if is_cupy_array(out):
                out.set(rows)
            else:
                np.copyto(out, rows)
            return out
        idx = to_gpu_indices(idx, num_rows)
        if out is None:
            out = cupy.empty((n, dim), dtype=table.dtype)
        if n == 0 or dim == 0:
            return out
        plan = plan_batch(idx, num_rows, stream=stream, presorted=sorted_indices,
                          caller="gather_rows")
        _launch_sorted_kernel("gather", table, plan, out, stream)
        plan.verdict.defer(_checks(), stream, keep=(table, out))
    return out


# ----------------------------------------------------------------------------- scatter


def scatter_rows(table, idx, src, *, stream=None, sorted_indices: bool = False):
    """``table[idx[i]] = src[i]`` in place; for a repeated index the last position wins.

    Returns ``table``. Paths and arguments as in :func:`gather_rows`; the GPU path runs when
    ``table``, ``idx`` or ``src`` is on the GPU (a NumPy table must then be pinned, or the rows
    go through the host).
    """
    return _scatter(table, idx, src, stream, sorted_indices, accumulate=False)


def scatter_add_rows(table, idx, src, *, stream=None, sorted_indices: bool = False):
    """``table[idx[i]] += src[i]`` in place, with the rows of repeated indices summed first.

    Deterministic: duplicates are summed in position order, in float32 (float64 for float64
    tables), then added to the row once. Tables of float32, float64, float16 or bfloat16.
    Returns ``table``.
    """
    return _scatter(table, idx, src, stream, sorted_indices, accumulate=True)


def _scatter(table, idx, src, stream, sorted_indices, *, accumulate: bool):
    if not accumulate and is_cupy_array(idx):
        fused = _fused("scatter", table, idx, src, stream, sorted_indices)
        if fused is not None:
            return fused
    _check_table(table)
    check_index_dtype(idx)
    num_rows = table.shape[0]
    n = idx.shape[0]
    _check_rows_arg(src, "src", table, n)
    _check_writable(table, "table")
    warn_slow_rows_path("scatter_add_rows" if accumulate else "scatter_rows", table, idx, src)
    if accumulate:
        _check_add_dtype(table)
    on_gpu = is_cupy_array(table) or is_cupy_array(idx) or is_cupy_array(src)
    if not on_gpu:
        check_host_indices(idx, num_rows)
        if sorted_indices:
            _check_host_order(idx)
        (_scatter_add_numpy if accumulate else _scatter_numpy)(table, idx, src)
        return table

    cupy = _cupy_for_gpu_path()
    stream = as_cupy_stream(stream)
    _poll_checks()
    with stream:
        if not _is_gpu_reachable(table):
            host_idx = cupy.asnumpy(idx, stream=stream) if is_cupy_array(idx) else idx
            host_src = cupy.asnumpy(src, stream=stream) if is_cupy_array(src) else src
            stream.synchronize()
            return _scatter(table, host_idx, host_src, None, sorted_indices,
                            accumulate=accumulate)
        idx = to_gpu_indices(idx, num_rows)
        if not _is_gpu_reachable(src):
            src = cupy.asarray(src)
        if n == 0 or table.shape[1] == 0:
            return table
        plan = plan_batch(idx, num_rows, stream=stream, presorted=sorted_indices,
                          caller="scatter_add_rows" if accumulate else "scatter_rows")
        _launch_sorted_kernel("add" if accumulate else "scatter", table, plan, src, stream)
        plan.verdict.defer(_checks(), stream, keep=(table, src))
    return table


def take_rows(table: np.ndarray, idx, out=None) -> np.ndarray:
    """``table[idx]`` into ``out``. np.take would first copy a table whose rows are strided
    (a column slice of a wider array) whole; indexing reads only the rows asked for."""
    if table.flags.c_contiguous:
        return np.take(table, idx, axis=0, out=out)
    rows = table[idx]
    if out is None:
        return rows
    out[...] = rows
    return out


def _scatter_numpy(table, idx, src):
    order = np.argsort(idx, kind="stable")
    rows = idx[order]
    last = np.ones(len(rows), dtype=bool)
    last[:-1] = rows[1:] != rows[:-1]
    table[rows[last]] = src[order[last]]


def _scatter_add_numpy(table, idx, src):
    if len(idx) == 0:
        return
    if np.may_share_memory(table, src):  # rows written below would change src's values
        src = src.copy()
    acc = np.float64 if table.dtype == np.float64 else np.float32
    order = np.argsort(idx, kind="stable")
    rows = idx[order]
    heads = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1])))
    counts = np.diff(np.append(heads, len(rows)))
    single = counts == 1
    # Rows hit once (most rows of a uniform batch): one fancy read-modify-write.
    once = rows[heads[single]]
    table[once] = (table[once].astype(acc) + src[order[heads[single]]].astype(acc)).astype(
        table.dtype)
    # Rows hit several times: sum their positions in order first. reduceat costs per run, so
    # it only sees these runs.
    if not single.all():
        in_multi = np.repeat(~single, counts)
        multi_counts = counts[~single]
        starts = np.concatenate(([0], np.cumsum(multi_counts)[:-1]))
        summed = np.add.reduceat(src[order[in_multi]].astype(acc), starts, axis=0)
        many = rows[heads[~single]]
        table[many] = (table[many].astype(acc) + summed).astype(table.dtype)


# ----------------------------------------------------------------------------- autodiff


def gather_rows_fwd(table, idx, out=None, *, stream=None):
    """Forward of the differentiable gather: ``(rows, residuals)``."""
    rows = gather_rows(table, idx, out=out, stream=stream)
    return rows, (idx, table.shape[0])


def gather_rows_bwd(residuals, grad_rows, out=None, *, stream=None):
    """Backward of the differentiable gather: the table gradient, zeros except the
    scatter-added ``grad_rows``. ``out`` (``(num_rows, dim)``, grad's dtype) is overwritten."""
    idx, num_rows = residuals
    shape = (num_rows, grad_rows.shape[1])
    if out is not None:  # the scatter's own checks first: nothing written on bad input
        _check_table(out)
        check_index_dtype(idx)
        _check_rows_arg(grad_rows, "grad_rows", out, idx.shape[0])
        if out.shape != shape:
            raise ValueError(f"out must have shape {shape}, got {out.shape}")
        _check_add_dtype(out)
        _check_writable(out, "out")
        if not (is_cupy_array(out) or is_cupy_array(idx)):
            check_host_indices(idx, num_rows)
    if out is None:
        if is_cupy_array(grad_rows):
            import cupy

            with as_cupy_stream(stream):
                out = cupy.zeros(shape, dtype=grad_rows.dtype)
        else:
            out = np.zeros(shape, dtype=grad_rows.dtype)
    elif is_cupy_array(out):
        if out.flags.c_contiguous:  # all-zero bits are 0.0 in every float type
            out.data.memset_async(0, out.nbytes, as_cupy_stream(stream))
        else:
            with as_cupy_stream(stream):
                out.fill(0)
    else:
        out[...] = 0
    return scatter_add_rows(out, idx, grad_rows, stream=stream)


# ----------------------------------------------------------------------------- helpers


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def _cupy_for_gpu_path():
    from xferlib._backend import require_cupy

    return require_cupy()
