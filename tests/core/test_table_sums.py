"""Gradient sums of host-table rows repeated thousands of times (runs across many chunks of
the two-pass sum) against a float64 reference, on the GPU."""

import numpy as np
import pytest

import xferlib


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1, 5, 128])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_long_runs_sum_like_the_reference(dim, dtype):
    import cupy

    rng = np.random.default_rng(dim)
    num_rows = 300
    # Row 7 repeated 5,000 times (about 160 chunks of 32), row 8 300 times, the rest rare.
    idx = np.concatenate([np.full(5000, 7), np.full(300, 8), rng.integers(0, num_rows, 1700)])
    idx = rng.permutation(idx)
    grads = rng.standard_normal((idx.size, dim)).astype(dtype)
    expected = np.zeros((num_rows, dim))
    np.add.at(expected, idx, -grads.astype(np.float64))  # SGD, lr 1, from zeros
    results = []
    for _ in range(2):
        table = xferlib.HostTable(num_rows, dim, dtype=dtype, optimizer="sgd",
                                  optimizer_kwargs={"lr": 1.0}, init="zeros")
        table.apply_gradients(cupy.asarray(idx), cupy.asarray(grads))
        results.append(np.array(table.numpy()))
    atol = 5e-3 if dtype == np.float32 else 1e-9
    np.testing.assert_allclose(results[0], expected, rtol=1e-5, atol=atol)
    np.testing.assert_array_equal(results[0], results[1])  # the same order every time
