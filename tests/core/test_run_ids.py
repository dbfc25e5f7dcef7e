"""The run numbering of sorted keys (one block, tiles of 4096) against NumPy."""

import numpy as np
import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 5, 1023, 4095, 4096, 4097, 65536, 100_003, 1 << 18])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_run_ids_match_numpy(n, dtype):
    import cupy

    from xferlib.batch import run_ids

    rng = np.random.default_rng(n)
    keys = np.sort(rng.integers(0, max(1, n // 3), n).astype(dtype))  # runs of every length
    expected = np.concatenate([[0], np.cumsum(keys[1:] != keys[:-1])]) if n else keys
    stream = cupy.cuda.get_current_stream()
    got = run_ids(cupy.asarray(keys), stream).get()
    np.testing.assert_array_equal(got, expected)


@pytest.mark.gpu
def test_run_ids_of_all_equal_and_all_distinct_keys():
    import cupy

    from xferlib.batch import run_ids

    stream = cupy.cuda.get_current_stream()
    same = cupy.full(10_000, 7, dtype=cupy.int64)
    np.testing.assert_array_equal(run_ids(same, stream).get(), np.zeros(10_000))
    distinct = cupy.arange(9_000, dtype=cupy.int32)
    np.testing.assert_array_equal(run_ids(distinct, stream).get(), np.arange(9_000))
