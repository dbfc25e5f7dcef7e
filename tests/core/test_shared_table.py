"""HostTable(shared=...): one table in host memory shared by the processes of a host."""

import multiprocessing
import os

import numpy as np
import pytest

import xferlib
from xferlib.table.shared import SharedMemory, owner_of, shared_memory_directory
from xferlib.testing import GPU_SKIP_REASON

ROWS, DIM = 37, 5


def _maps(name):
    with open("/proc/self/maps") as f:
        return [line for line in f if name in line]


def _state(table):
    return {n: np.array(table.state(n)) for n in table.state_names()}


@pytest.mark.parametrize("name, hyper", [("adam", {"lr": 0.01, "amsgrad": True}),
                                         ("rowwise_adagrad", {"lr": 0.1}),
                                         ("sgd", {"lr": 0.1, "momentum": 0.9})])
def test_opened_table_sees_the_creators_rows_and_state(rng, name, hyper):
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    table = xferlib.HostTable(ROWS, DIM, optimizer=name, optimizer_kwargs=hyper,
                              init=init.copy(), shared=True)
    other = xferlib.HostTable(ROWS, DIM, optimizer=name, optimizer_kwargs=hyper,
                              shared=table.shared_name)
    private = xferlib.HostTable(ROWS, DIM, optimizer=name, optimizer_kwargs=hyper,
                                init=init.copy())
    np.testing.assert_array_equal(other.numpy(), init)
    for step in range(3):  # the two handles write the rows they own (row % 2)
        idx = rng.integers(0, ROWS, 20)
        grads = rng.standard_normal((20, DIM)).astype(np.float32)
        private.apply_gradients(idx, grads)
        for rank, handle in enumerate((table, other)):
            mine = owner_of(idx, 2) == rank
            handle.apply_gradients(idx[mine], grads[mine])
    np.testing.assert_array_equal(table.numpy(), private.numpy())
    for key, value in _state(private).items():
        np.testing.assert_array_equal(_state(other)[key], value, err_msg=key)
    other.close()
    table.close()


def test_close_unlinks_and_unmaps():
    table = xferlib.HostTable(ROWS, DIM, optimizer="adagrad", shared=True)
    name = table.shared_name
    path = os.path.join(shared_memory_directory(), name)
    assert os.path.exists(path) and _maps(name)
    other = xferlib.HostTable(ROWS, DIM, optimizer="adagrad", shared=name)
    table.close()
    assert not os.path.exists(path)  # the creator unlinked the name ...
    assert _maps(name)  # ... the opener still maps the memory
    assert float(other.numpy().sum()) == float(other.numpy().sum())
    other.close()
    assert not _maps(name)
    table.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        table.numpy()
    with pytest.raises(ValueError, match="closed"):
        other.apply_gradients(np.array([1]), np.ones((1, DIM), np.float32))


def test_forgotten_creator_unlinks_when_collected():
    import gc

    table = xferlib.HostTable(4, 2, shared=True)
    path = os.path.join(shared_memory_directory(), table.shared_name)
    del table
    gc.collect()
    assert not os.path.exists(path)


def test_bad_shared_arguments():
    table = xferlib.HostTable(ROWS, DIM, optimizer="adam", shared=True)
    with pytest.raises(ValueError, match=r"optimizer='adam' there, 'sgd' here"):
        xferlib.HostTable(ROWS, DIM, optimizer="sgd", shared=table.shared_name)
    with pytest.raises(ValueError, match="num_rows=37 there, 38 here"):
        xferlib.HostTable(ROWS + 1, DIM, optimizer="adam", shared=table.shared_name)
    with pytest.raises(ValueError, match="hyper"):
        xferlib.HostTable(ROWS, DIM, optimizer="adam", optimizer_kwargs={"lr": 0.5},
                          shared=table.shared_name)
    with pytest.raises(FileNotFoundError, match="no shared memory"):
        xferlib.HostTable(ROWS, DIM, shared="xferlib-0-000000000000")
    with pytest.raises(ValueError, match="name"):
        xferlib.HostTable(ROWS, DIM, shared="../etc/passwd")
    with pytest.raises(TypeError, match="shared"):
        xferlib.HostTable(ROWS, DIM, shared=3)
    with pytest.raises(ValueError, match="cache"):
        xferlib.HostTable(ROWS, DIM, cache_rows=8, shared=True)
    with pytest.raises(ValueError, match="init array"):
        xferlib.HostTable(ROWS, DIM, init=np.zeros((ROWS, DIM + 1), np.float32), shared=True)
    table.close()
    with pytest.raises(ValueError, match="world_size"):
        owner_of(np.arange(3), 0)


def test_block_larger_than_the_ram_disk_raises_memory_error(monkeypatch):
    monkeypatch.setenv("XFERLIB_HOST_MEMORY_CHECK", "0")
    before = set(os.listdir(shared_memory_directory()))
    with pytest.raises(MemoryError, match="shared host table"):
        SharedMemory.create(1 << 60, {}, pin=False)
    assert set(os.listdir(shared_memory_directory())) <= before  # nothing left behind


def test_shared_memory_on_an_empty_table():
    table = xferlib.HostTable(0, 3, optimizer="sgd", shared=True)
    other = xferlib.HostTable(0, 3, optimizer="sgd", shared=table.shared_name)
    assert other.numpy().shape == (0, 3)
    other.close()
    table.close()


def _child(name, gpu, queue):
    """Another process: opens the table, updates the rows it owns (odd ones), reports what
    it read before."""
    try:
        table = xferlib.HostTable(ROWS, DIM, optimizer="sgd", optimizer_kwargs={"lr": 1.0},
                                  shared=name)
        idx = np.arange(ROWS)
        if gpu:
            import cupy

            seen = table.lookup(cupy.asarray(idx)).get()
            mine = cupy.asarray(idx[idx % 2 == 1])
            table.apply_gradients(mine, cupy.ones((mine.size, DIM), cupy.float32))
        else:
            seen = table.lookup(idx)
            mine = idx[idx % 2 == 1]
            table.apply_gradients(mine, np.ones((mine.size, DIM), np.float32))
        table.close()
        queue.put(seen)
    except BaseException as err:  # the parent reports it
        queue.put(repr(err))


def _in_another_process(gpu):
    init = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
    table = xferlib.HostTable(ROWS, DIM, optimizer="sgd", optimizer_kwargs={"lr": 1.0},
                              init=init.copy(), shared=True)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(table.shared_name, gpu, queue))
    child.start()
    seen = queue.get(timeout=120)
    child.join(timeout=60)
    assert not isinstance(seen, str), seen
    np.testing.assert_array_equal(seen, init)
    expected = init - (np.arange(ROWS) % 2 == 1)[:, None]
    if gpu:
        import cupy

        got = table.lookup(cupy.arange(ROWS)).get()
    else:
        got = table.lookup(np.arange(ROWS))
    np.testing.assert_array_equal(got, expected)
    table.close()


def test_another_process_reads_and_writes_the_table():
    _in_another_process(gpu=False)


@pytest.mark.gpu
def test_another_process_reads_and_writes_the_table_on_its_gpu():
    if not xferlib.cupy_available():
        pytest.skip(GPU_SKIP_REASON)
    _in_another_process(gpu=True)


def test_numpy_scalar_hyperparameters():
    """The header is JSON: NumPy scalars (as tests/core/test_table.py allows) raised
    json's TypeError from the constructor."""
    hyper = {"lr": np.float32(0.1), "betas": (np.float32(0.8), 0.9)}
    table = xferlib.HostTable(ROWS, DIM, optimizer="adam", optimizer_kwargs=hyper,
                              shared=True)
    other = xferlib.HostTable(ROWS, DIM, optimizer="adam", optimizer_kwargs=hyper,
                              shared=table.shared_name)
    assert other.hyper == table.hyper and table.hyper["lr"] == float(np.float32(0.1))
    other.close()
    table.close()
