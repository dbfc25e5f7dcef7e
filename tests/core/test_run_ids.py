"""The run numbering of sorted keys and each run's first position (one block up to 4096
positions, a block per tile of 4096 above) against NumPy."""

import numpy as np
import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 5, 1023, 4095, 4096, 4097, 65536, 100_003, 1 << 18, 4_500_001])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_run_ids_match_numpy(n, dtype):
    import cupy

    from xferlib.batch import run_ids

    rng = np.random.default_rng(n)
    keys = np.sort(rng.integers(0, max(1, n // 3), n).astype(dtype))  # runs of every length
    expected = np.concatenate([[0], np.cumsum(keys[1:] != keys[:-1])]) if n else keys
    stream = cupy.cuda.get_current_stream()
    run, starts = run_ids(cupy.asarray(keys), stream)
    np.testing.assert_array_equal(run.get(), expected)
    firsts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]])) if n else keys
    np.testing.assert_array_equal(starts.get()[:firsts.size], firsts)


@pytest.mark.gpu
def test_run_ids_of_all_equal_and_all_distinct_keys():
    import cupy

    from xferlib.batch import run_ids

    stream = cupy.cuda.get_current_stream()
    for n in (3_000, 10_000):  # one block, and a block per tile
        run, starts = run_ids(cupy.full(n, 7, dtype=cupy.int64), stream)
        np.testing.assert_array_equal(run.get(), np.zeros(n))
        assert int(starts[0]) == 0
        run, starts = run_ids(cupy.arange(n, dtype=cupy.int32), stream)
        np.testing.assert_array_equal(run.get(), np.arange(n))
        np.testing.assert_array_equal(starts.get(), np.arange(n))
