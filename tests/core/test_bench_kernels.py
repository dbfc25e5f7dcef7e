"""The benchmark's reference kernels (``xferlib.bench.kernels.scattered_rows_launches``): the
plain read of a table's scattered rows returns their bytes, the write puts them back, rows
outside the table are skipped, and tables they cannot serve are refused."""

import numpy as np
import pytest

import xferlib
from xferlib.bench.kernels import scattered_rows_launches


def _table(optimizer, rows=1000, dim=24):
    import cupy

    table = xferlib.HostTable(rows, dim, optimizer=optimizer, init=("uniform", -1.0, 1.0),
                              seed=3)
    table.lookup(cupy.arange(4))  # builds the GPU side
    table.apply_gradients(cupy.arange(4), cupy.ones((4, dim), cupy.float32))  # steps > 0
    table.check()
    return table


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_read_returns_the_rows_and_write_puts_them_back(optimizer):
    import cupy

    table = _table(optimizer)
    before = np.array(table.numpy())
    states = {name: np.array(table.state(name)) for name in table.state_names()}
    rows = np.array([0, 2, 3, 17, 500, 999, 998])
    read, write, buffer = scattered_rows_launches(table, cupy.asarray(rows))
    read()
    got = cupy.asnumpy(buffer)
    weights = got[:, :table.dim * 4].copy().view(np.float32)
    np.testing.assert_array_equal(weights, before[rows])
    buffer[:] = 0  # the write puts back the buffer as it is now: zeros
    write()
    cupy.cuda.Device().synchronize()
    after = np.array(table.numpy())
    np.testing.assert_array_equal(after[rows], 0.0)
    untouched = np.setdiff1d(np.arange(table.num_rows), rows)
    np.testing.assert_array_equal(after[untouched], before[untouched])
    for name, state in states.items():
        np.testing.assert_array_equal(np.array(table.state(name))[untouched], state[untouched])


@pytest.mark.gpu
def test_a_read_then_a_write_leaves_the_table_unchanged():
    import cupy

    table = _table("adam")
    before = np.array(table.numpy())
    states = {name: np.array(table.state(name)) for name in table.state_names()}
    read, write, _ = scattered_rows_launches(table, cupy.asarray([1, 3, 5, 400]))
    read()
    write()
    cupy.cuda.Device().synchronize()
    np.testing.assert_array_equal(np.array(table.numpy()), before)
    for name, state in states.items():
        np.testing.assert_array_equal(np.array(table.state(name)), state)


@pytest.mark.gpu
def test_rows_outside_the_table_are_skipped():
    import cupy

    table = _table("sgd", rows=64)
    before = np.array(table.numpy())
    read, write, buffer = scattered_rows_launches(table, cupy.asarray([-1, 5, 64, 1 << 40]))
    buffer[:] = 7
    read()
    got = cupy.asnumpy(buffer)
    assert (got[[0, 2, 3]] == 7).all()
    np.testing.assert_array_equal(got[1, :table.dim * 4].copy().view(np.float32), before[5])
    write()
    cupy.cuda.Device().synchronize()
    np.testing.assert_array_equal(np.array(table.numpy()), before)


def test_a_table_without_a_gpu_side_is_refused():
    table = xferlib.HostTable(16, 8, optimizer="sgd")
    with pytest.raises(ValueError, match="no GPU side yet"):
        scattered_rows_launches(table, None)
