import numpy as np
import pytest

import xferlib
from xferlib.testing import assert_matches_reference, random_rows

DTYPES = ["float32", "float16", "bfloat16", "float64"]
# (rows in table, row width, batch): awkward sizes, an empty batch, a width that is not a
# multiple of the 16-byte word, a batch bigger than the table (many duplicates).
SIZES = [(1, 1, 1), (5, 3, 7), (4097, 33, 4097), (100, 128, 0), (17, 64, 300), (1000, 5, 64)]


def _indices(rng, num_rows, n, index_dtype):
    return rng.integers(0, num_rows, size=n).astype(index_dtype)


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_gather_rows_matches_reference(backend, rng, size, dtype, index_dtype):
    num_rows, dim, n = size
    host_table = random_rows(rng, (num_rows, dim), dtype)
    host_idx = _indices(rng, num_rows, n, index_dtype)
    out = xferlib.gather_rows(backend.table(host_table), backend.array(host_idx))
    assert out.shape == (n, dim) and out.dtype == host_table.dtype
    assert_matches_reference(backend.to_host(out),
                             xferlib.gather_rows_reference(host_table, host_idx), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_gather_rows_into_out(backend, rng, size, dtype):
    num_rows, dim, n = size
    host_table = random_rows(rng, (num_rows, dim), dtype)
    host_idx = _indices(rng, num_rows, n, "int64")
    out = backend.array(np.zeros((n, dim), dtype=host_table.dtype))
    result = xferlib.gather_rows(backend.table(host_table), backend.array(host_idx), out=out)
    assert result is out
    np.testing.assert_array_equal(backend.to_host(out).astype(np.float64),
                                  xferlib.gather_rows_reference(host_table, host_idx))


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_scatter_rows_last_write_wins(backend, rng, size, dtype, index_dtype):
    num_rows, dim, n = size
    host_table = random_rows(rng, (num_rows, dim), dtype)
    host_idx = _indices(rng, num_rows, n, index_dtype)
    host_src = random_rows(rng, (n, dim), dtype)
    table = backend.table(host_table)
    assert xferlib.scatter_rows(table, backend.array(host_idx), backend.array(host_src)) is table
    expected = xferlib.scatter_rows_reference(host_table, host_idx, host_src)
    np.testing.assert_array_equal(backend.to_host(table).astype(np.float64), expected)


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_scatter_add_rows_sums_duplicates(backend, rng, size, dtype, index_dtype):
    num_rows, dim, n = size
    host_table = random_rows(rng, (num_rows, dim), dtype)
    host_idx = _indices(rng, num_rows, n, index_dtype)
    host_src = random_rows(rng, (n, dim), dtype)
    table = backend.table(host_table)
    xferlib.scatter_add_rows(table, backend.array(host_idx), backend.array(host_src))
    expected = xferlib.scatter_add_rows_reference(host_table, host_idx, host_src)
    most_repeats = np.bincount(host_idx, minlength=1).max() if n else 1
    assert_matches_reference(backend.to_host(table), expected, dtype,
                             scale=4 * (1 + most_repeats))


def test_scatter_add_rows_is_deterministic(backend, rng):
    host_table = random_rows(rng, (50, 40), "float32")
    host_idx = rng.integers(0, 5, size=5000)
    host_src = random_rows(rng, (5000, 40), "float32")
    results = []
    for _ in range(3):
        table = backend.table(host_table)
        xferlib.scatter_add_rows(table, backend.array(host_idx), backend.array(host_src))
        results.append(backend.to_host(table))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


def test_heavy_duplicates_single_row(backend, rng):
    host_table = random_rows(rng, (3, 8), "float64")
    host_idx = np.full(1000, 2, dtype=np.int64)
    host_src = random_rows(rng, (1000, 8), "float64")
    table = backend.table(host_table)
    xferlib.scatter_add_rows(table, backend.array(host_idx), backend.array(host_src))
    assert_matches_reference(
        backend.to_host(table),
        xferlib.scatter_add_rows_reference(host_table, host_idx, host_src), "float64", scale=1e3)
    out = xferlib.gather_rows(table, backend.array(host_idx))
    assert np.all(backend.to_host(out) == backend.to_host(out)[:1])


@pytest.mark.parametrize("bad", [-1, 10, 2**40])
@pytest.mark.parametrize("op", ["gather", "scatter", "scatter_add"])
def test_bad_index_raises_before_any_write(backend, rng, op, bad):
    host_table = random_rows(rng, (10, 4), "float32")
    host_idx = np.array([0, 3, bad, 5, bad], dtype=np.int64)
    host_src = random_rows(rng, (5, 4), "float32")
    table = backend.table(host_table)
    with pytest.raises(IndexError, match=rf"index {bad} at position 2 .* 10 rows"):
        if op == "gather":
            xferlib.gather_rows(table, backend.array(host_idx))
        elif op == "scatter":
            xferlib.scatter_rows(table, backend.array(host_idx), backend.array(host_src))
        else:
            xferlib.scatter_add_rows(table, backend.array(host_idx), backend.array(host_src))
        xferlib.check_rows()  # a GPU call's verdict is read later, without a host sync
    np.testing.assert_array_equal(backend.to_host(table), host_table)


def test_bad_dtypes_and_shapes(backend, rng):
    table = backend.table(random_rows(rng, (10, 4), "float32"))
    idx = backend.array(np.array([1, 2], dtype=np.int64))
    with pytest.raises(TypeError, match="int32 or int64"):
        xferlib.gather_rows(table, backend.array(np.array([1.0, 2.0])))
    with pytest.raises(ValueError, match="1-D"):
        xferlib.gather_rows(table, backend.array(np.zeros((2, 2), dtype=np.int64)))
    with pytest.raises(ValueError, match=r"src must have shape \(2, 4\)"):
        xferlib.scatter_rows(table, idx, backend.array(np.zeros((3, 4), np.float32)))
    with pytest.raises(TypeError, match="src dtype float64"):
        xferlib.scatter_add_rows(table, idx, backend.array(np.zeros((2, 4), np.float64)))
    with pytest.raises(ValueError, match="2-D"):
        xferlib.gather_rows(backend.array(np.zeros(10, np.float32)), idx)
    with pytest.raises(TypeError, match="numpy.ndarray or cupy.ndarray"):
        xferlib.gather_rows([[1.0]], idx)
    int_table = backend.table(np.arange(40, dtype=np.int32).reshape(10, 4))
    with pytest.raises(TypeError, match="scatter_add_rows needs"):
        xferlib.scatter_add_rows(int_table, idx, backend.array(np.zeros((2, 4), np.int32)))
    # copies of integer rows are fine
    np.testing.assert_array_equal(backend.to_host(xferlib.gather_rows(int_table, idx)),
                                  np.arange(40, dtype=np.int32).reshape(10, 4)[[1, 2]])


def test_strided_table_rows(backend, rng):
    wide = random_rows(rng, (20, 12), "float32")
    host_table = wide[:, :8]  # row stride 48 B, rows of 32 B
    table = backend.table(np.ascontiguousarray(wide))[:, :8]
    idx = np.array([19, 0, 7, 7], dtype=np.int32)
    out = xferlib.gather_rows(table, backend.array(idx))
    np.testing.assert_array_equal(backend.to_host(out), host_table[idx])


def test_unique_indices(backend, rng):
    host_idx = rng.integers(0, 50, size=500).astype(np.int64)
    unique, inverse = xferlib.unique_indices(backend.array(host_idx))
    unique, inverse = backend.to_host(unique), backend.to_host(inverse)
    np.testing.assert_array_equal(unique, np.unique(host_idx))
    np.testing.assert_array_equal(unique[inverse], host_idx)


def test_gather_fwd_bwd_matches_reference(backend, rng):
    host_table = random_rows(rng, (30, 6), "float32")
    host_idx = rng.integers(0, 30, size=100).astype(np.int64)
    host_g = random_rows(rng, (100, 6), "float32")
    rows, residuals = xferlib.gather_rows_fwd(backend.table(host_table), backend.array(host_idx))
    assert_matches_reference(backend.to_host(rows), host_table[host_idx], "float32")
    grad = xferlib.gather_rows_bwd(residuals, backend.array(host_g))
    expected = xferlib.scatter_add_rows_reference(np.zeros((30, 6)), host_idx, host_g)
    assert_matches_reference(backend.to_host(grad), expected, "float32", scale=10)


@pytest.mark.parametrize("sort", ["fused", "tiles", "device-wide"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_large_batches(backend, rng, index_dtype, sort, monkeypatch):
    # Batches above one block's tile (16384 positions): one fused launch (gather, scatter),
    # or planned: sorted tiles merged pairwise (three tiles: a tile without a partner in the
    # first round), or CuPy's device-wide argsort.
    if sort != "fused":
        monkeypatch.setattr(xferlib.rows_fused, "FUSED_MAX", 0)
    if sort == "device-wide":
        monkeypatch.setattr(xferlib.batch, "TILED_SORT_MAX", 1000)
    num_rows, dim, n = 5000, 24, 40000
    host_table = random_rows(rng, (num_rows, dim), "float32")
    host_idx = rng.integers(0, num_rows, size=n).astype(index_dtype)
    host_src = random_rows(rng, (n, dim), "float32")
    out = xferlib.gather_rows(backend.table(host_table), backend.array(host_idx))
    np.testing.assert_array_equal(backend.to_host(out), host_table[host_idx])
    table = backend.table(host_table)
    xferlib.scatter_rows(table, backend.array(host_idx), backend.array(host_src))
    np.testing.assert_array_equal(backend.to_host(table).astype(np.float64),
                                  xferlib.scatter_rows_reference(host_table, host_idx, host_src))
    table = backend.table(host_table)
    xferlib.scatter_add_rows(table, backend.array(host_idx), backend.array(host_src))
    assert_matches_reference(
        backend.to_host(table),
        xferlib.scatter_add_rows_reference(host_table, host_idx, host_src), "float32", scale=40)
    bad = host_idx.copy()
    bad[30000] = num_rows
    with pytest.raises(IndexError, match=f"index {num_rows} at position 30000"):
        xferlib.scatter_add_rows(table, backend.array(bad), backend.array(host_src))
        xferlib.check_rows()


@pytest.mark.parametrize("path", ["fused", "planned"])
@pytest.mark.parametrize("n", [7, 3000, 40000])
@pytest.mark.parametrize("op", ["gather", "scatter", "scatter_add"])
def test_sorted_indices_promise_is_kept_and_checked(backend, rng, op, n, path, monkeypatch):
    if path == "planned":
        if not backend.gpu or op == "scatter_add":
            pytest.skip("one path only")
        monkeypatch.setattr(xferlib.rows_fused, "FUSED_MAX", 0)
    num_rows, dim = 1000, 12
    host_table = random_rows(rng, (num_rows, dim), "float32")
    host_idx = np.sort(rng.integers(0, num_rows, size=n))
    host_src = random_rows(rng, (n, dim), "float32")

    def run(table, idx):
        if op == "gather":
            return xferlib.gather_rows(table, backend.array(idx), sorted_indices=True)
        if op == "scatter":
            return xferlib.scatter_rows(table, backend.array(idx), backend.array(host_src),
                                        sorted_indices=True)
        return xferlib.scatter_add_rows(table, backend.array(idx), backend.array(host_src),
                                        sorted_indices=True)

    result = backend.to_host(run(backend.table(host_table), host_idx))
    if op == "gather":
        expected = xferlib.gather_rows_reference(host_table, host_idx)
    elif op == "scatter":
        expected = xferlib.scatter_rows_reference(host_table, host_idx, host_src)
    else:
        expected = xferlib.scatter_add_rows_reference(host_table, host_idx, host_src)
    assert_matches_reference(result, expected, "float32", scale=200)

    unsorted = host_idx.copy()
    unsorted[:2] = [num_rows - 1, 0]  # a descent at position 1
    table = backend.table(host_table)
    with pytest.raises(ValueError, match=f"index 0 at position 1 comes after {num_rows - 1}"):
        run(table, unsorted)
        xferlib.check_rows()
    np.testing.assert_array_equal(backend.to_host(table), host_table)


@pytest.mark.gpu
def test_bad_gpu_batch_raises_at_the_next_call_and_writes_nothing(rng):
    # The GPU path does not wait for its index check: the bad call returns and writes nothing;
    # a later call that finds its verdict in (or check_rows) raises before it queues anything.
    import cupy

    from xferlib.testing import get_backend

    gpu = get_backend("cupy")
    host_table = random_rows(rng, (10, 4), "float32")
    table = gpu.table(host_table)
    src = gpu.array(random_rows(rng, (3, 4), "float32"))
    xferlib.scatter_rows(table, gpu.array(np.array([1, 10, 2])), src)
    cupy.cuda.get_current_stream().synchronize()  # the verdict is in
    with pytest.raises(IndexError, match="^index 10 at position 1 .* 10 rows .*of scatter_rows on the GPU"):
        xferlib.scatter_rows(table, gpu.array(np.array([4, 5, 6])), src)
    np.testing.assert_array_equal(gpu.to_host(table), host_table)  # neither call wrote
    xferlib.gather_rows(table, gpu.array(np.array([0, 3], dtype=np.int32)))
    xferlib.check_rows()  # nothing pending is bad
    for _ in range(9):  # more calls than verdicts may wait: the oldest are read on the way
        xferlib.scatter_add_rows(table, gpu.array(np.array([0, 0, 9])), src)
    xferlib.check_rows()
    expected = host_table.astype(np.float64)
    np.add.at(expected, np.array([0, 0, 9] * 9), np.tile(gpu.to_host(src), (9, 1)))
    assert_matches_reference(gpu.to_host(table), expected, "float32", scale=30)


@pytest.mark.gpu
def test_gpu_calls_captured_in_a_cuda_graph(rng):
    # No host sync, so a gather + scatter-add can be captured once and replayed on new
    # indices; check_rows() reads the verdicts the replays wrote (after a synchronize).
    import cupy

    from xferlib.testing import get_backend

    get_backend("cupy")  # skips without a GPU
    n, dim, rows_n = 300, 8, 1000
    table = cupy.asarray(random_rows(rng, (rows_n, dim), "float32"))
    src = cupy.asarray(random_rows(rng, (n, dim), "float32"))
    idx_buf = cupy.zeros(n, dtype=np.int64)
    out = cupy.zeros((n, dim), dtype=np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()  # the graph's buffers: never handed to anyone else
    # made on the legacy default stream, which a non-blocking one does not wait for
    cupy.cuda.Device().synchronize()

    def step():
        xferlib.gather_rows(table, idx_buf, out=out, stream=stream)
        xferlib.scatter_add_rows(table, idx_buf, src, stream=stream)

    with cupy.cuda.using_allocator(pool.malloc), stream:
        step()  # compiles and sizes every buffer outside the capture
        xferlib.check_rows()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    expected = table.get().astype(np.float64)
    with stream:
        for _ in range(3):
            idx = rng.integers(0, rows_n, n)
            idx_buf.set(idx, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            assert_matches_reference(out.get(), expected[idx], "float32", scale=20)
            np.add.at(expected, idx, src.get().astype(np.float64))
        xferlib.check_rows()
        assert_matches_reference(table.get(), expected, "float32", scale=20)
        before = table.get()
        idx[7] = rows_n
        idx_buf.set(idx, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        # Both captured calls saw the bad index: each is reported once, by a check of its own.
        reported = set()
        for _ in range(2):
            with pytest.raises(IndexError, match=f"index {rows_n} at position 7") as error:
                xferlib.check_rows()
            # the call that queued the bad batch is named after the index and position
            reported.add(str(error.value).split("earlier call of ")[1].split(" ")[0])
        assert reported == {"gather_rows", "scatter_add_rows"}
        np.testing.assert_array_equal(table.get(), before)  # the bad replay wrote nothing
        xferlib.check_rows()  # and nothing more


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("table_kind", ["cupy", "pinned"])
def test_fused_calls_match_numpy_many_times(rng, index_dtype, table_kind):
    # The one-launch path: scatters whose repeated rows sit in different blocks' chunks
    # (last position wins), pinned and CuPy rows, more calls than verdict slots (the ring and
    # the kernels' ticket counters are reused), a bad batch at the last position, a stream.
    import cupy

    from xferlib.memory import pinned_empty
    from xferlib.testing import get_backend

    get_backend("cupy")  # skips without a GPU
    num_rows, dim = 700, 20  # 80 B rows: 16-byte words
    host_table = random_rows(rng, (num_rows, dim), "float32")
    if table_kind == "cupy":
        table = cupy.asarray(host_table)
    else:
        table = pinned_empty(host_table.shape, host_table.dtype)
        table[...] = host_table
    expected = host_table.astype(np.float64)
    stream = cupy.cuda.Stream(non_blocking=True)
    pinned_out = pinned_empty((5000, dim), np.float32)
    cupy.cuda.Device().synchronize()
    with stream:  # arrays made below are filled on `stream` too
        _fused_calls_many_times(rng, table, expected, stream, pinned_out, index_dtype)


def _fused_calls_many_times(rng, table, expected, stream, pinned_out, index_dtype):
    import cupy

    num_rows, dim = table.shape
    for step in range(150):
        n = int(rng.choice([1, 5, 1000, 5000]))
        host_idx = rng.integers(0, num_rows, size=n).astype(index_dtype)
        host_src = random_rows(rng, (n, dim), "float32")
        idx = cupy.asarray(host_idx)
        out = pinned_out[:n] if step % 3 == 0 else None
        got = xferlib.gather_rows(table, idx, out=out, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(got), expected[host_idx])
        xferlib.scatter_rows(table, idx, cupy.asarray(host_src), stream=stream)
        expected = xferlib.scatter_rows_reference(expected, host_idx, host_src)
    xferlib.check_rows()
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(table).astype(np.float64), expected)
    bad = rng.integers(0, num_rows, size=3000).astype(index_dtype)
    bad[-1] = num_rows
    with pytest.raises(IndexError, match=f"^index {num_rows} at position 2999 .*of scatter_rows on the GPU"):
        xferlib.scatter_rows(table, cupy.asarray(bad), cupy.ones((3000, dim), np.float32),
                             stream=stream)
        xferlib.check_rows()
    np.testing.assert_array_equal(cupy.asnumpy(table).astype(np.float64), expected)


@pytest.mark.gpu
def test_fused_calls_captured_in_a_cuda_graph(rng):
    # The one-launch gather and scatter write their verdict into a slot of their own at every
    # replay; check_rows() reads it after a synchronize and reports a bad replay once.
    import cupy

    from xferlib.testing import get_backend

    get_backend("cupy")  # skips without a GPU
    n, dim, rows_n = 3000, 8, 1000
    table = cupy.asarray(random_rows(rng, (rows_n, dim), "float32"))
    src = cupy.asarray(random_rows(rng, (n, dim), "float32"))
    idx_buf = cupy.zeros(n, dtype=np.int32)
    out = cupy.zeros((n, dim), dtype=np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        xferlib.gather_rows(table, idx_buf, out=out, stream=stream)
        xferlib.check_rows()
        stream.begin_capture()
        xferlib.gather_rows(table, idx_buf, out=out, stream=stream)
        xferlib.scatter_rows(table, idx_buf, src, stream=stream)
        graph = stream.end_capture()
        expected = table.get().astype(np.float64)
        for _ in range(3):
            idx = rng.integers(0, rows_n, n).astype(np.int32)
            idx_buf.set(idx, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            np.testing.assert_array_equal(out.get(), expected[idx])
            expected = xferlib.scatter_rows_reference(expected, idx, src.get())
        xferlib.check_rows()
        np.testing.assert_array_equal(table.get(), expected)
        idx[11] = -3
        idx_buf.set(idx, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        with pytest.raises(IndexError, match="index -3 at position 11"):
            xferlib.check_rows()
        np.testing.assert_array_equal(table.get(), expected)  # the bad replay wrote nothing
        xferlib.check_rows()  # reported once


def test_empty_tables_overlapping_sources_and_a_backward_checked_first():
    """A table of no rows takes an empty batch (NumPy gives it any strides); a scatter-add
    whose source overlaps the table sums as NumPy's add.at does; gather_rows_bwd checks its
    input before it zeroes ``out``."""
    empty = np.zeros((0, 3), np.float32)
    none = np.zeros(0, np.int64)
    assert xferlib.gather_rows(empty, none).shape == (0, 3)
    with pytest.raises(IndexError, match="table of 0 rows"):
        xferlib.gather_rows(empty, np.array([0]))
    table = np.arange(8, dtype=np.float32).reshape(4, 2)
    expected = table.copy()
    idx = np.array([2, 1, 2])
    np.add.at(expected, idx, table[1:4].copy())
    xferlib.scatter_add_rows(table, idx, table[1:4])  # src overlaps the rows written
    np.testing.assert_array_equal(table, expected)
    out = np.full((4, 2), 7.0, np.float32)
    with pytest.raises(IndexError, match="index 9"):
        xferlib.gather_rows_bwd((np.array([1, 9]), 4), np.ones((2, 2), np.float32), out=out)
    assert (out == 7.0).all()


def test_backward_into_an_integer_out_refuses_before_it_zeroes():
    """gather_rows_bwd checks ``out``'s dtype (scatter_add_rows takes float tables only)
    before it zeroes ``out``: the TypeError leaves it as it was."""
    out = np.full((3, 2), 7, np.int32)
    with pytest.raises(TypeError, match="float32, float64, float16 or bfloat16"):
        xferlib.gather_rows_bwd((np.array([0]), 3), np.ones((1, 2), np.int32), out=out)
    assert (out == 7).all()


def test_read_only_outputs_are_refused_naming_the_argument():
    """A read-only ``out`` (gather, backward) or ``table`` (scatter, scatter-add) raises a
    ValueError naming it, before anything is written; a read-only source or table to read
    from is fine."""
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    table.flags.writeable = False
    idx, src = np.array([1, 0]), np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(xferlib.gather_rows(table, idx), table[idx])
    out = np.zeros((2, 3), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        xferlib.gather_rows(table, idx, out=out)
    for op in (xferlib.scatter_rows, xferlib.scatter_add_rows):
        with pytest.raises(ValueError, match="table is read-only"):
            op(table, idx, src)
    grad_out = np.full((4, 3), 7.0, np.float32)
    grad_out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        xferlib.gather_rows_bwd((idx, 4), src, out=grad_out)
    writable = table.copy()
    src.flags.writeable = False
    xferlib.scatter_rows(writable, idx, src)
    np.testing.assert_array_equal(writable[:2], 1.0)
